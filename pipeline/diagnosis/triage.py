"""What the recorded statistics alone say about a trial: no torch, no replay (the healthy path)."""

from __future__ import annotations

import math
from typing import Literal

from pipeline.artifacts import forecast, reference
from pipeline.artifacts.comparison import Stats
from pipeline.artifacts.diagnosis import Diagnosis
from pipeline.artifacts.steps import Steps
from pipeline.config import Policy


def triage(stats: Stats, trial_steps: Steps, failing: list[str]) -> Diagnosis:
    """Findings from the recorded statistics alone: non-finite outputs by case kind, first non-finite
    training step; ``failing`` is the rule's verdict on the trial (its reasons), computed once by the stage."""
    findings: list[str] = []
    for name, gap in sorted(stats.values.items()):
        for kind, g in sorted(gap.per_kind.items()):
            if g.nonfinite_trial_only:
                findings.append(f"output '{name}' is non-finite on {g.nonfinite_trial_only} element(s) of {kind} cases")
    first_loss = first_nonfinite_step(trial_steps, "loss")
    if first_loss is not None:
        findings.append(f"first non-finite loss at training step {first_loss}")
    first_grad = first_nonfinite_step(trial_steps, "grad_norm")
    if first_grad is not None:
        findings.append(f"first non-finite gradient norm at training step {first_grad} (the scaler skips such updates)")
    return Diagnosis(needed=bool(failing), failing=list(failing), findings=findings)


def first_nonfinite_step(steps: Steps, key: Literal["loss", "grad_norm", ""] = "") -> int | None:
    """The first step whose ``key`` (both loss and gradient norm when none is given) is not finite."""
    keys = (key,) if key else ("loss", "grad_norm")
    return next((s.step for s in steps if any(not math.isfinite(getattr(s, k)) for k in keys)), None)


def forecast_check(policy: Policy, stats: Stats, steps: Steps) -> forecast.ForecastCheck | None:
    """freeze's FP16 forecast against what a float16 trial did (``policy`` as it ran); None for other variants."""
    if not policy.uses_scaler:
        return None
    finite = stats.nonfinite.trial.rows == 0 and stats.nonfinite.trained.rows == 0
    return forecast.check(reference.read_forecast(), steps, finite, policy.fp32_modules)
