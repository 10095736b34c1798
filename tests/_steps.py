"""Trajectory rows for tests: ``artifacts.steps.StepRecord`` with the fields a test does not care about filled in."""

from __future__ import annotations

from pipeline.artifacts.steps import StepRecord


def step(i: int = 0, loss: float = 1.0, *, grad_norm: float = 1.0, scale: float = 1.0, skipped: bool = False,
         lr: float = 0.1, nonfinite_grad: bool = False) -> StepRecord:
    """Update ``i``: every update before it real unless the test says otherwise (``real_updates`` is i + 1)."""
    return StepRecord(step=i, loss=loss, grad_norm=grad_norm, scale=scale, skipped=skipped, real_updates=i + 1, lr=lr,
                      nonfinite_grad=nonfinite_grad)
