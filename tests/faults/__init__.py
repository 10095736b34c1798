"""Fault injection for the tests that stop a real stage process mid-run.

The pipeline reads no fault variable: ``training.train`` takes an ``on_step`` hook. A stage run with the
environment of ``after_step`` finds this folder first on its path, so Python imports this folder's
``sitecustomize`` when it starts, in every process (torchrun's ranks included); that module hands every
``train`` call the hook that stops the process.
"""

from __future__ import annotations

import os
from pathlib import Path


def after_step(env: dict[str, str], step: int, stop: bool = False, rank: int | None = None) -> dict[str, str]:
    """``env`` for a stage that kills itself with SIGKILL (``stop``: freezes itself with SIGSTOP, for a kill
    from outside) after step ``step`` of its trainings counted one after the other (freeze: the reference's
    steps 1..S, then the FP32 replicate's S+1..2S). Under torchrun, rank ``rank`` only (default: every rank)."""
    out = dict(env, PIPELINE_FAULT_AFTER_STEP=str(step), PIPELINE_FAULT_SIGNAL="SIGSTOP" if stop else "SIGKILL")
    if rank is not None:
        out["PIPELINE_FAULT_RANK"] = str(rank)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p)
    return out
