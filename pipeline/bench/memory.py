"""Peak memory of each variant's steps, measured before anything is timed.

GPU: each variant in a fresh process of its own (``MemoryProbes`` runs ``python -m pipeline.bench.probe``
once per variant, one after the other), so one variant's cached blocks never count for another and two large
models never compete for the device. CPU: in this process, one variant after the other, each freed before
the next is built (torch's CPU allocator caches nothing; ``malloc_trim`` gives freed heap pages back), the
peak resident set reset through ``/proc/self/clear_refs`` before each round.

Under FSDP2 (``distributed.strategy: fsdp``) a probe's own process has no process group, so it could not shard:
there, on a GPU too, every rank measures in its own process, one variant after the other, each freed (and the
allocator's cache emptied) before the next is built; rank 0 records its figures.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline import distributed, precision
from pipeline.artifacts.benchmark import AMP, TF32, MemoryProbe
from pipeline.bench.sizing import sizes
from pipeline.bench.timing import skipped_since, update_count
from pipeline.bench.arms import Arm
from pipeline.bench.workload import load_workload, step_for
from pipeline.config import Params
from pipeline.errors import UserError
from pipeline.files import from_jsonable, to_jsonable

PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
"""Environment of a memory probe's process. Large host buffers go through mmap and return to the OS when
freed (read by glibc at process start). One thread: a step's tensors do not depend on it."""


def peak_memory(step: Callable[[], None], warmup: int, repeats: int, steps: int, device: torch.device) -> MemoryProbe:
    """Peak memory of ``steps`` steps, per round, in THIS process (on a GPU: call it in a fresh one)."""
    for _ in range(warmup):
        step()
    peaks: list[float] = []
    baselines: list[float] = []
    skipped: list[int] = []

    def run_steps() -> None:
        before = update_count(step)
        for _ in range(steps):
            step()
        skipped.append(skipped_since(step, before, steps))

    if device.type == "cuda":
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            baselines.append(float(torch.cuda.memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
            run_steps()
            torch.cuda.synchronize(device)
            peaks.append(float(torch.cuda.max_memory_allocated(device)))
        return MemoryProbe(
            tuple(peaks), tuple(baselines), tuple(skipped), "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
        )
    if not _reset_peak_rss():
        # No resettable peak (not Linux, or /proc read-only): the process's lifetime peak, one sample.
        run_steps()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return MemoryProbe((float(peak),), (float("nan"),), tuple(skipped), "getrusage ru_maxrss (process lifetime)")
    for _ in range(repeats):
        _trim_heap()
        baselines.append(float(_proc_status_bytes("VmRSS")))
        _reset_peak_rss()
        run_steps()
        peaks.append(float(_proc_status_bytes("VmHWM")))
    return MemoryProbe(
        tuple(peaks), tuple(baselines), tuple(skipped), "peak resident set (VmHWM) reset via /proc/self/clear_refs"
    )


def arm_memory(params: Params, variant: str, arm: Arm, device: torch.device) -> MemoryProbe:
    """One arm's ``peak_memory``: its workload built, stepped under its policy, measured."""
    work = load_workload(params, device, variant if arm.name == AMP else None)
    step = step_for(work, arm.policy)
    size = sizes(params.bench, device.type)
    with precision.fp32_regions(step.model, arm.policy, device), precision.tf32(arm.tf32):
        return peak_memory(step, size.warmup, size.repeats, size.steps, device)


def memory_by_arm(
    params_path: str, params: Params, variant: str, chosen: list[Arm], device: torch.device
) -> dict[str, MemoryProbe]:
    """Each arm's figures (TF32 stores what FP32 stores: not measured), before any timing.

    GPU: a fresh process per arm, from rank 0 alone (other ranks get none). CPU, and a GPU under FSDP2 (a probe's
    process has no group to shard in): here, one arm after the other, each freed before the next is built; under
    torchrun every rank measures, so that DDP's or FSDP2's collectives pair up.
    """
    chosen = [v for v in chosen if v.name != TF32]
    if device.type == "cuda" and not distributed.current().sharded:
        if not distributed.current().writes:
            return {}
        with MemoryProbes(params_path, variant, [a.name for a in chosen]) as probes:
            return probes.collect()
    out = {}
    for a in chosen:
        out[a.name] = arm_memory(params, variant, a, device)
        gc.collect()  # the arm's model and optimizer state go before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()  # nor do its cached blocks stay reserved
    return out


class MemoryProbes:
    """``python -m pipeline.bench.probe`` once per arm, each in a fresh process, one after the other (so
    two large models never compete for the device's memory), run by ``collect``.
    """

    def __init__(self, params_path: str, variant: str, names: list[str], cwd: str | Path = ".") -> None:
        self.env = dict(os.environ, **PROBE_ENV)
        self.cwd = cwd
        self.cmds = {
            n: [sys.executable, "-m", "pipeline.bench.probe", "--params", params_path, "--variant", variant, "--arm", n]
            for n in names
        }
        self.running: dict[str, subprocess.Popen] = {}

    def collect(self) -> dict[str, MemoryProbe]:
        """Each arm's figures.

        Raises:
            UserError: a child stopped on a user mistake (its one line is passed on).
            RuntimeError: a child crashed (a bug: its stderr is attached).
        """
        out = {}
        for name, cmd in self.cmds.items():
            proc = self.running[name] = subprocess.Popen(
                cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            stdout, stderr = proc.communicate()
            if proc.returncode == 2:
                raise UserError(stderr.strip().splitlines()[-1].removeprefix("error: "))
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-3000:]}")
            out[name] = MemoryProbe.from_dict(from_jsonable(json.loads(stdout.strip().splitlines()[-1])))
        return out

    def __enter__(self) -> MemoryProbes:
        return self

    def __exit__(self, *exc: object) -> None:
        # A stage that stopped early leaves no child behind.
        for proc in self.running.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def probe_line(probe: MemoryProbe) -> str:
    """How a probe's process hands its figures back: one JSON line (``collect`` reads the last line)."""
    return json.dumps(to_jsonable(asdict(probe)))


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so the round's baseline is live memory only."""
    try:
        # The symbols already loaded into this process: no library search, no subprocess.
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, the baseline is a little high
        pass


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current resident size (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")
