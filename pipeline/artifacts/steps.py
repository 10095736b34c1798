"""One optimizer update as every trajectory file holds it: the rows of ``data/reference/trajectory.json``, of the
noise replicate's, of ``data/trial/NAME/trajectory.json`` and of the resume state (torch-free, so that compare,
diagnose, report and publish read them typed)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.artifacts.record import Record


@dataclass(frozen=True)
class StepRecord(Record):
    """One optimizer update of the training loop (``pipeline.training``), key for key as the files hold it."""

    step: int
    loss: float
    grad_norm: float
    scale: float
    skipped: bool
    real_updates: int
    lr: float
    nonfinite_grad: bool = False
    """The gradient norm was not finite without a GradScaler to skip it (bfloat16, FP32): the update was not applied."""
    batch_sha256: str = ""
    """sha256 of the bytes of every micro-batch this step read (inputs and targets, as read): the trial and every
    resume compare it with the reference's, so a non-deterministic Dataset cannot pass unseen."""


Steps = tuple[StepRecord, ...]
"""A run's updates in order."""
