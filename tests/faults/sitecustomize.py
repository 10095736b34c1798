"""Imported by Python at the start of a stage process whose path begins with this folder (``faults.after_step``).

Once ``pipeline.training`` has been imported, each of its ``train`` calls that saves resume states gets an ``on_step``
hook that sends this process ``PIPELINE_FAULT_SIGNAL`` after step ``PIPELINE_FAULT_AFTER_STEP``, counting the steps
of the process's resumable trainings one after the other (freeze's probe of its first updates is none); under
torchrun only on rank ``PIPELINE_FAULT_RANK`` when it is set. Nothing else in the process changes: torch is imported
when the stage imports it, not before, and the resume key is the one of a run without this module.

Once ``pipeline.files`` has been imported, with ``PIPELINE_FAULT_ENOSPC_AFTER_BYTES`` set, its ``atomic_file`` (through
which every output file is written) hands out handles that fail as a full filesystem does, ``OSError(ENOSPC)``, once
the process has written that many bytes to files under ``PIPELINE_FAULT_ENOSPC_UNDER`` (folders separated by
``os.pathsep``; default data/).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.abc
import importlib.machinery
import os
import signal
import sys

AFTER = int(os.environ.get("PIPELINE_FAULT_AFTER_STEP", "0"))
SIGNAL = getattr(signal, os.environ.get("PIPELINE_FAULT_SIGNAL", "SIGKILL"))
RANK = os.environ.get("PIPELINE_FAULT_RANK")
ENOSPC_AFTER = os.environ.get("PIPELINE_FAULT_ENOSPC_AFTER_BYTES")
ENOSPC_UNDER = os.environ.get("PIPELINE_FAULT_ENOSPC_UNDER", "data")


def install(training) -> None:
    """Wrap ``training.train``: every caller (the stages, ``run_trial``) looks it up on the module."""
    train, done = training.train, [0]

    def train_with_fault(*args, **kwargs):
        if kwargs.get("save_resume") is None:  # a probe's or a replay's few updates: no run a kill could resume
            return train(*args, **kwargs)
        before = done[0]

        def on_step(step: int) -> None:
            if before + step == AFTER and RANK in (None, os.environ.get("RANK", "0")):
                os.kill(os.getpid(), SIGNAL)

        result = train(*args, on_step=on_step, **kwargs)
        done[0] += len(result.records)
        return result

    training.train = train_with_fault


class _Full:
    """A file handle that writes until the process's budget of bytes is spent, then raises ENOSPC as the kernel would
    (the bytes that still fit are written first)."""

    def __init__(self, handle, left: list[int]) -> None:
        self._handle, self._left = handle, left

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B"))
        if size > self._left[0]:
            self._handle.write(memoryview(data).cast("B")[: self._left[0]])
            self._left[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left[0] -= size
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def install_full_disk(files) -> None:
    """Wrap ``files.atomic_file``: ``write_bytes`` looks it up on the module, the other writers import it after this."""
    atomic_file, left = files.atomic_file, [int(ENOSPC_AFTER)]
    folders = [os.path.abspath(folder) for folder in ENOSPC_UNDER.split(os.pathsep)]

    @contextlib.contextmanager
    def atomic_file_on_a_small_disk(path):
        with atomic_file(path) as handle:
            inside = any(os.path.abspath(path).startswith(folder + os.sep) for folder in folders)
            yield _Full(handle, left) if inside else handle

    files.atomic_file = atomic_file_on_a_small_disk


class _AfterTrainingImport(importlib.abc.MetaPathFinder):
    """Finds ``pipeline.training`` (``pipeline.files``) as Python would, and installs the hook once the module has run."""

    hooks = {}

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run, install = spec.loader.exec_module, self.hooks[name]

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
    _AfterTrainingImport.hooks["pipeline.training"] = install
if ENOSPC_AFTER is not None:
    _AfterTrainingImport.hooks["pipeline.files"] = install_full_disk
if _AfterTrainingImport.hooks:
    sys.meta_path.insert(0, _AfterTrainingImport())
