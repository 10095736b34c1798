"""Imported by Python at the start of a stage process whose path begins with this folder (``faults.after_step``).

Once ``pipeline.training`` has been imported, each of its ``train`` calls gets an ``on_step`` hook that
sends this process ``PIPELINE_FAULT_SIGNAL`` after step ``PIPELINE_FAULT_AFTER_STEP``, counting the steps
of the process's trainings one after the other; under torchrun only on rank ``PIPELINE_FAULT_RANK`` when
it is set. Nothing else in the process changes: torch is imported when the stage imports it, not before,
and the resume key is the one of a run without this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys

AFTER = int(os.environ.get("PIPELINE_FAULT_AFTER_STEP", "0"))
SIGNAL = getattr(signal, os.environ.get("PIPELINE_FAULT_SIGNAL", "SIGKILL"))
RANK = os.environ.get("PIPELINE_FAULT_RANK")


def install(training) -> None:
    """Wrap ``training.train``: every caller (the stages, ``run_trial``) looks it up on the module."""
    train, done = training.train, [0]

    def train_with_fault(*args, **kwargs):
        before = done[0]

        def on_step(step: int) -> None:
            if before + step == AFTER and RANK in (None, os.environ.get("RANK", "0")):
                os.kill(os.getpid(), SIGNAL)

        result = train(*args, on_step=on_step, **kwargs)
        done[0] += len(result.records)
        return result

    training.train = train_with_fault


class _AfterTrainingImport(importlib.abc.MetaPathFinder):
    """Finds ``pipeline.training`` as Python would, and installs the hook once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != "pipeline.training":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            install(module)
            # Out of sys.modules now (not while it is still being imported, which importlib forbids): a resume
            # state is keyed on every imported module outside the installation (checkpoint.code_digest), and
            # the killed run must save under the key of the rerun, which runs without this module; otherwise
            # every rerun would restart from step 0 and no kill test would exercise a resume.
            sys.modules.pop(__name__, None)

        spec.loader.exec_module = exec_module
        return spec


if AFTER:
    sys.meta_path.insert(0, _AfterTrainingImport())
