"""Diagnostics of a trial: what went wrong first, and where.

``triage`` reads the comparison statistics and the training record only, so the stage costs nothing
when all is well.
"""

from __future__ import annotations

import math

from pipeline.config import AcceptanceConfig


def triage(stats: dict, trial_steps: list[dict], rule: AcceptanceConfig) -> dict:
    """Findings from the recorded statistics: non-finite outputs by case kind, first non-finite training step."""
    findings: list[str] = []
    for name, gap in sorted(stats["values"].items()):
        for kind, g in sorted(gap["per_kind"].items()):
            if g["nonfinite_trial_only"]:
                findings.append(f"output '{name}' is non-finite on {g['nonfinite_trial_only']} element(s) of {kind} cases")
    first_loss = next((s["step"] for s in trial_steps if not math.isfinite(s["loss"])), None)
    if first_loss is not None:
        findings.append(f"first non-finite loss at training step {first_loss}")
    first_grad = next((s["step"] for s in trial_steps if not math.isfinite(s["grad_norm"])), None)
    if first_grad is not None:
        findings.append(f"first non-finite gradient norm at training step {first_grad} (the scaler skips such updates)")
    return {"findings": findings, "needed": bool(findings)}
