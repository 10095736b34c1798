"""What is timed against what: strict FP32, TF32 where the GPU has it, the trial variant's policy, and strict FP32
again (the A/A arm: timed in the same rounds, it shows what a speedup of nothing measures on this machine)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import devices
from pipeline.artifacts.benchmark import AMP, FP32, FP32_AGAIN, TF32
from pipeline.config import Policy


@dataclass(frozen=True)
class Arm:
    name: str
    """``fp32`` (strict), ``tf32``, ``amp`` (the variant's policy, whatever it changes) or ``fp32_again``."""
    policy: Policy
    """Precision policy: FP32 eager for the baselines, the trial variant's whole policy for ``amp``."""
    tf32: bool
    """TF32 allowed for FP32 matmuls and convolutions while this arm runs."""


def arms(policy: Policy, env: devices.Environment) -> tuple[list[Arm], str]:
    """The arms whose memory and time are measured on the device ``env`` describes, and a note on the TF32 baseline."""
    out = [Arm(FP32, Policy(), tf32=False)]
    has_tf32, note = devices.tf32_available(env)
    if has_tf32:
        out.append(Arm(TF32, Policy(), tf32=True))
    # AMP keeps FP32 strict outside autocast too, so that the policy is the only difference from ``fp32``.
    out.append(Arm(AMP, policy, tf32=False))
    return out, note


def timed_arms(measured: list[Arm]) -> list[Arm]:
    """``measured`` and the A/A arm, timed in the same rounds (it stores what ``fp32`` stores: its memory is not
    measured). Its model, optimizer and batch are its own, built as ``fp32``'s are; the rotation moves it through every
    position in the round as it moves the others."""
    return [*measured, Arm(FP32_AGAIN, Policy(), tf32=False)]
