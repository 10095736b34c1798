"""Time and peak memory of training steps, strict FP32 against AMP, measured so the figures can be quoted.

The method, and why:

- Same work as the trial: the task's model from the reference's initial weights, the trial's first batch
  (same shape, same batch size), the trial's optimizer, clipping and precision policy (FP32 modules
  included). The only change is what the trial adds for evidence: no loss read-back, no scale check, no
  per-step record and no learning-rate schedule (each needs a host sync), so none sits in the timed region.
  The one sync left is GradScaler's own inf check in ``scaler.step``: it is part of what FP16 training costs.
- Warm-up first (allocator, kernel selection, autocast weight cache), then rounds: each round times
  ``steps`` steps of every variant, the order rotating from round to round, so drift (clocks, thermals,
  other load) hits all variants alike and each round gives a paired ratio.
- Clocks: on a GPU, CUDA events around the steps with a synchronize before and after; on the CPU,
  ``time.perf_counter`` (monotonic).
- Baselines: ``fp32`` is strict FP32 (TF32 off for matmul and cuDNN), so the speedup is AMP's alone.
  Where the GPU has TF32 (NVIDIA capability 8.0+), ``tf32`` is timed beside it: it is what FP32 code gets
  there when TF32 is enabled, and AMP should be compared with it too.
- Memory: each variant runs in its own fresh process (``python -m pipeline.benchmark``), so one variant's
  cached blocks never count for the other. GPU: ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``. CPU: the process's peak resident memory (VmHWM), reset through
  ``/proc/self/clear_refs`` before each round, with large blocks mmapped so freed memory leaves the process
  (probes run single-threaded: a step's tensors do not depend on the thread count).
- Figures: median and interquartile range over rounds; speedup (fp32 / amp time) and memory ratio (amp /
  fp32 peak) from per-round pairs, with their own median and IQR.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import checkpoint, devices, paths, precision, task, training
from pipeline.artifacts import read_tensors
from pipeline.config import Params, load_params
from pipeline.errors import UserError
from pipeline.precision import Policy

# Environment of a memory probe. Large buffers (activations, gradients) go through mmap and return to the OS
# when freed, so the resident size follows live memory instead of glibc's heap high-water mark (read by
# glibc at process start). One thread: a step's tensors do not depend on the thread count, and probes
# running side by side then take one core each instead of fighting over all of them.
_PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


# --- statistics (pure) --------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default method) of a non-empty list, ``q`` in [0, 1]."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles, IQR (absolute and relative to the median), extremes and count."""
    median = quantile(values, 0.5)
    q1, q3 = quantile(values, 0.25), quantile(values, 0.75)
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "rel_iqr": (q3 - q1) / abs(median) if median else math.inf,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def ratio_spread(num: list[float], den: list[float]) -> dict[str, float]:
    """Spread of per-round ratios ``num[i] / den[i]`` (rounds are paired: they share conditions)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio of {len(num)} and {len(den)} values: give the same non-zero count")
    return spread([n / d for n, d in zip(num, den)])


# --- variants -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    """``fp32`` (strict), ``tf32`` or ``amp``."""
    policy: Policy
    """Precision policy: no dtype for the FP32 baselines, the trial's dtype and FP32 modules for ``amp``."""
    tf32: bool
    """TF32 allowed for FP32 matmuls and convolutions while this variant runs."""


def variants(dtype: str, fp32_modules: tuple[str, ...], env: dict[str, str]) -> tuple[list[Variant], str]:
    """The variants to measure on the device ``env`` describes, and a note on the TF32 baseline."""
    out = [Variant("fp32", Policy(), tf32=False)]
    has_tf32, note = devices.tf32_available(env)
    if has_tf32:
        out.append(Variant("tf32", Policy(), tf32=True))
    # AMP keeps FP32 strict outside autocast too, so that autocast is the only difference from ``fp32``.
    out.append(Variant("amp", Policy(dtype=dtype, fp32_modules=fp32_modules), tf32=False))
    return out, note


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """Allow or forbid TF32 for FP32 matmuls and cuDNN convolutions, restoring the previous setting after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# --- workload -----------------------------------------------------------------------------------------


@dataclass
class Workload:
    """What one variant trains: a model in its initial state and one batch, on the device."""

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    params: Params
    device: torch.device


def load_workload(params: Params, device: torch.device) -> Workload:
    """The reference's initial model and the trial's first batch (read from the stages' outputs).

    Raises:
        UserError: prepare or freeze has not run.
    """
    train_t, _ = read_tensors(paths.PREPARED_TRAIN, produced_by="prepare")
    idx = training.batch_order(train_t["x"].shape[0], params.reference.batch_size, 1, params.seed)[0]
    model = task.build_model(params.task, params.seed)
    checkpoint.restore(checkpoint.load(paths.REF_INIT), model, rng=False)
    return Workload(model.to(device).train(), train_t["x"][idx].to(device), train_t["y"][idx].to(device), params, device)


def make_step(work: Workload, policy: Policy) -> Callable[[], None]:
    """One training step in the trial's order, with nothing read back to the host."""
    cfg = work.params.reference
    loss_fn = training.loss_function(work.params.task.loss)
    optimizer = training.make_optimizer(work.model, cfg)
    scaler = precision.make_scaler(policy, work.device)
    trainable = [p for p in work.model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    model, x, y = work.model, work.x, work.y

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(policy, work.device):
            loss = loss_fn(task.primary(task.named_outputs(model(x))), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(trainable, max_norm=max_norm)
        scaler.step(optimizer)
        scaler.update()

    return step


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- timing -------------------------------------------------------------------------------------------


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` back-to-back steps."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000.0 / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def interleaved(
    steps_by_variant: dict[str, tuple[Callable[[], None], bool]],
    warmup: int,
    repeats: int,
    steps: int,
    device: torch.device,
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one value per round.

    ``steps_by_variant`` maps a name to its step function and whether TF32 is allowed while it runs. Round
    ``r`` runs the variants starting from the ``r``-th, so none is always first (or always after another).
    """
    names = list(steps_by_variant)
    for name in names:
        step, tf32 = steps_by_variant[name]
        with matmul_precision(tf32):
            for _ in range(warmup):
                step()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, tf32 = steps_by_variant[name]
            with matmul_precision(tf32):
                times[name].append(time_steps(step, steps, device))
    return times


# --- memory -------------------------------------------------------------------------------------------


def peak_memory(step: Callable[[], None], warmup: int, repeats: int, steps: int, device: torch.device) -> dict:
    """Peak memory of ``steps`` steps, per round, in THIS process (call it in a fresh one).

    Returns ``peak`` (bytes: max allocated on a GPU, peak resident set on the CPU), ``baseline`` (the same
    measure just before the round: weights, optimizer state, batch) and ``method``.
    """
    for _ in range(warmup):
        step()
    peaks: list[float] = []
    baselines: list[float] = []
    if device.type == "cuda":
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            baselines.append(float(torch.cuda.memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
            peaks.append(float(torch.cuda.max_memory_allocated(device)))
        return {"peak": peaks, "baseline": baselines, "method": "torch.cuda.max_memory_allocated after reset_peak_memory_stats"}
    if not _reset_peak_rss():
        # No resettable peak (not Linux, or /proc read-only): the process's lifetime peak, one sample.
        for _ in range(steps):
            step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"peak": [float(peak)], "baseline": [float("nan")], "method": "getrusage ru_maxrss (process lifetime)"}
    for _ in range(repeats):
        _trim_heap()
        baselines.append(float(_proc_status_bytes("VmRSS")))
        _reset_peak_rss()
        for _ in range(steps):
            step()
        peaks.append(float(_proc_status_bytes("VmHWM")))
    return {"peak": peaks, "baseline": baselines, "method": "peak resident set (VmHWM) reset via /proc/self/clear_refs"}


class MemoryProbes:
    """``python -m pipeline.benchmark`` once per variant, each in a fresh process: start them, then collect.

    On the CPU they run side by side: peak resident memory is per process, and CPU contention does not
    change it; the caller may load its own models meanwhile, but must ``collect`` before timing anything.
    On a GPU they run one after the other, so two large models never compete for the device's memory.
    """

    def __init__(self, params_path: str, dtype: str, names: list[str], parallel: bool, cwd: str | Path = ".") -> None:
        self.env = dict(os.environ, **_PROBE_ENV)
        self.cwd, self.parallel = cwd, parallel
        self.cmds = {
            n: [sys.executable, "-m", "pipeline.benchmark", "--params", params_path, "--dtype", dtype, "--variant", n]
            for n in names
        }
        self.running = {n: self._start(n) for n in names} if parallel else {}

    def _start(self, name: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.cmds[name], cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def collect(self) -> dict[str, dict]:
        """Each variant's figures (``peak_memory``'s result).

        Raises:
            UserError: a child stopped on a user mistake (its one line is passed on).
            RuntimeError: a child crashed (a bug: its stderr is attached).
        """
        out = {}
        for name, cmd in self.cmds.items():
            proc = self.running[name] if self.parallel else self._start(name)
            stdout, stderr = proc.communicate()
            if proc.returncode == 2:
                raise UserError(stderr.strip().splitlines()[-1].removeprefix("error: "))
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-3000:]}")
            out[name] = json.loads(stdout.strip().splitlines()[-1])
        return out

    def __enter__(self) -> MemoryProbes:
        return self

    def __exit__(self, *exc: object) -> None:
        # A stage that stopped early leaves no child behind.
        for proc in self.running.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def memory_summary(by_variant: dict[str, dict]) -> dict:
    """Peak and working memory (peak minus baseline) per variant, and the AMP / FP32 ratios of both."""
    out: dict = {"peak_memory_bytes": {}, "working_memory_bytes": {}}
    for name, m in by_variant.items():
        out["peak_memory_bytes"][name] = spread(m["peak"])
        working = [p - b for p, b in zip(m["peak"], m["baseline"])]
        if all(math.isfinite(w) for w in working):
            out["working_memory_bytes"][name] = spread(working)
    if "fp32" in by_variant and "amp" in by_variant:
        fp32, amp = by_variant["fp32"], by_variant["amp"]
        n = min(len(fp32["peak"]), len(amp["peak"]))
        out["memory_ratio"] = ratio_spread(amp["peak"][:n], fp32["peak"][:n])
        if {"fp32", "amp"} <= set(out["working_memory_bytes"]):
            wa = [p - b for p, b in zip(amp["peak"][:n], amp["baseline"][:n])]
            wf = [p - b for p, b in zip(fp32["peak"][:n], fp32["baseline"][:n])]
            if all(w > 0 for w in wf):
                out["working_memory_ratio"] = ratio_spread(wa, wf)
    return out


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


# --- child process entry point --------------------------------------------------------------------------


def _child(argv: list[str] | None = None) -> int:
    """``python -m pipeline.benchmark --dtype D --variant V``: print one variant's memory figures as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.benchmark", description="Peak memory of one benchmark variant, in this process."
    )
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--variant", required=True, choices=("fp32", "tf32", "amp"))
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
        device = devices.resolve(params.device)
        chosen = {v.name: v for v in variants(args.dtype, tuple(params.trial.fp32_modules), devices.describe(device))[0]}
        if args.variant not in chosen:
            raise UserError(f"--variant {args.variant} is not measured on this device; use one of {sorted(chosen)}")
        variant = chosen[args.variant]
        work = load_workload(params, device)
        step = make_step(work, variant.policy)
        bench = params.bench
        with precision.fp32_regions(work.model, variant.policy, device), matmul_precision(variant.tf32):
            result = peak_memory(step, bench.warmup, bench.repeats, bench.steps, device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
