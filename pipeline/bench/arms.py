"""What is timed against what: strict FP32, TF32 where the GPU has it, and the trial variant's policy."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import devices
from pipeline.config import Policy


@dataclass(frozen=True)
class Arm:
    name: str
    """``fp32`` (strict), ``tf32`` or ``amp`` (the variant's policy, whatever it changes)."""
    policy: Policy
    """Precision policy: FP32 eager for the baselines, the trial variant's whole policy for ``amp``."""
    tf32: bool
    """TF32 allowed for FP32 matmuls and convolutions while this arm runs."""


def arms(policy: Policy, env: devices.Environment) -> tuple[list[Arm], str]:
    """The arms to measure on the device ``env`` describes, and a note on the TF32 baseline."""
    out = [Arm("fp32", Policy(), tf32=False)]
    has_tf32, note = devices.tf32_available(env)
    if has_tf32:
        out.append(Arm("tf32", Policy(), tf32=True))
    # AMP keeps FP32 strict outside autocast too, so that the policy is the only difference from ``fp32``.
    out.append(Arm("amp", policy, tf32=False))
    return out, note
