"""What is timed against what: strict FP32, TF32 where the GPU has it, and the trial's AMP policy."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import devices
from pipeline.precision import Policy


@dataclass(frozen=True)
class Variant:
    name: str
    """``fp32`` (strict), ``tf32`` or ``amp``."""
    policy: Policy
    """Precision policy: no dtype for the FP32 baselines, the trial's dtype and FP32 modules for ``amp``."""
    tf32: bool
    """TF32 allowed for FP32 matmuls and convolutions while this variant runs."""


def variants(dtype: str, fp32_modules: tuple[str, ...], env: dict[str, str]) -> tuple[list[Variant], str]:
    """The variants to measure on the device ``env`` describes, and a note on the TF32 baseline."""
    out = [Variant("fp32", Policy(), tf32=False)]
    has_tf32, note = devices.tf32_available(env)
    if has_tf32:
        out.append(Variant("tf32", Policy(), tf32=True))
    # AMP keeps FP32 strict outside autocast too, so that autocast is the only difference from ``fp32``.
    out.append(Variant("amp", Policy(dtype=dtype, fp32_modules=fp32_modules), tf32=False))
    return out, note
