"""Time and peak memory of training steps, strict FP32 against AMP, measured so the figures can be quoted.

The method, and why:

- Same work as the trial: the task's model from the reference's initial weights, the trial's first update
  (same micro-batches, same batch size), the trial's optimizer, clipping and precision policy (FP32 modules
  included), stepped by the ONE update function the trial uses (``training.amp_step``, ``read_back=False``).
  The only change is what the trial adds for evidence: no loss read-back, no scale check, no per-step record
  and no learning-rate schedule (each needs a host sync), so none sits in the timed region. The one sync left
  is GradScaler's own inf check in ``scaler.step``: it is part of what FP16 training costs.
- No skipped step is timed: the FP16 scaler starts from the trial's FINAL state (``grad_scaler`` in the trial
  checkpoint), not a fresh one at 65536 that overflows and halves through the first rounds; and every
  optimizer update is counted (a step post-hook, no sync), so a round in which the scaler still skipped an
  update (cheaper: no optimizer step) is dropped, for every variant alike, and reported.
- Sized by device (``bench`` params left null): short on the CPU, where the figures only show the method
  works (the record says so); long enough on a GPU for quotable medians.
- Warm-up first (allocator, kernel selection, autocast weight cache), then rounds: each round times
  ``steps`` steps of every variant, the order rotating from round to round, so drift (clocks, thermals,
  other load) hits all variants alike and each round gives a paired ratio.
- Clocks: on a GPU, CUDA events around the steps with a synchronize before and after; on the CPU,
  ``time.perf_counter`` (monotonic).
- Baselines: ``fp32`` is strict FP32 (TF32 off for matmul and cuDNN), so the speedup is AMP's alone.
  Where the GPU has TF32 (NVIDIA capability 8.0+), ``tf32`` is timed beside it: it is what FP32 code gets
  there when TF32 is enabled, and AMP should be compared with it too.
- Memory, before anything is timed. GPU: each variant in its own fresh process (``python -m
  pipeline.benchmark``), one after the other, so one variant's cached blocks never count for the other;
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: in the stage's own process, one
  variant after the other, each freed before the next starts (torch's CPU allocator caches nothing, and
  ``malloc_trim`` gives freed heap pages back before each round); the process's peak resident memory (VmHWM),
  reset through ``/proc/self/clear_refs`` before each round. A fresh process per variant would cost a torch
  start-up each, for the same figures.
- Figures: median and interquartile range over rounds (nearest-rank quantiles, ``numerics.quantile``); speedup (fp32 / amp time) and memory ratio (amp /
  fp32 peak) from per-round pairs, with their own median and IQR.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import checkpoint, devices, distributed, paths, precision, task, training
from pipeline.config import Params, load_params
from pipeline.errors import UserError
from pipeline.compare.numerics import quantile
from pipeline.precision import Policy

# Environment of a memory probe (a GPU variant's own process). Large host buffers go through mmap and return
# to the OS when freed (read by glibc at process start). One thread: a step's tensors do not depend on it.
_PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


# --- statistics (pure) --------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles, IQR (absolute and relative to the median), extremes and count.

    Quantiles are the project's one definition (``numerics.quantile``, nearest rank): a median is always a
    value that was measured."""
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


# Sizes when params leave ``bench`` fields null: (warmup, repeats, steps).
SIZES = {"cpu": (2, 5, 3), "gpu": (10, 20, 20)}


@dataclass(frozen=True)
class Sizes:
    warmup: int
    repeats: int
    steps: int
    note: str


def sizes(bench, device: torch.device) -> Sizes:
    """The rounds to run: params ``bench`` where set, else sized by device (short on the CPU, saying so)."""
    kind = "gpu" if device.type == "cuda" else "cpu"
    auto = SIZES[kind]
    chosen = [auto[i] if v is None else v for i, v in enumerate((bench.warmup, bench.repeats, bench.steps))]
    note = "set in params (bench)" if all(v is not None for v in (bench.warmup, bench.repeats, bench.steps)) else (
        "sized for the CPU: a short run that shows the method works; its figures say little about a GPU"
        if kind == "cpu"
        else "sized for a GPU: enough rounds for medians and IQRs to quote"
    )
    return Sizes(*chosen, note=note)


# --- workload -----------------------------------------------------------------------------------------


@dataclass
class Workload:
    """What one variant trains: a model in its initial state and the trial's first update, on the device."""

    model: torch.nn.Module
    micro_batches: list[tuple[task.Inputs, torch.Tensor]]
    params: Params
    device: torch.device
    scaler_state: dict
    """The trial's final GradScaler ``state_dict`` (empty for bfloat16 or without a trial)."""


def load_workload(params: Params, device: torch.device, dtype: str | None = None) -> Workload:
    """The reference's initial model, the trial's first update's micro-batches and (with ``dtype``) the scaler
    state the trial of ``dtype`` ended with (read from the stages' outputs).

    Raises:
        UserError: prepare, freeze or trial@DTYPE has not run.
    """
    from pipeline.artifacts import trial as trial_artifact

    source = task.load_train(params.task, paths.PREPARED_TRAIN)
    first_update = training.update_batches(len(source), params.reference, params.seed)[0]
    micro = []
    for idx in first_update:
        x, y = source.batch(distributed.current().shard(idx))  # under torchrun: this rank's slice
        micro.append((task.to_device(x, device), y.to(device)))
    model = task.build_model(params.task, params.seed)
    checkpoint.restore(checkpoint.load(paths.REF_INIT), model, rng=False)
    scaler_state = {}
    if dtype is not None and Policy(dtype=dtype).uses_scaler:  # bfloat16 runs no scaler: nothing to read
        scaler_state = trial_artifact.load(dtype).checkpoint().meta.get("grad_scaler") or {}
    return Workload(model.to(device).train(), micro, params, device, scaler_state)


class TrainingStep:
    """One training update of the trial's, by ``training.amp_step`` with nothing read back to the host.

    ``updates`` counts the optimizer updates really made (a step post-hook: GradScaler calls
    ``optimizer.step`` only when the gradients are finite), so a caller can tell skipped steps apart
    without a sync of its own.
    """

    def __init__(self, work: Workload, policy: Policy) -> None:
        cfg = work.params.reference
        self.work, self.policy = work, policy
        self.loss_fn = training.make_loss(work.params.task)
        self.optimizer = training.make_optimizer(work.model, cfg)
        self.scaler = precision.make_scaler(policy, work.device)
        if self.scaler.is_enabled() and work.scaler_state:
            self.scaler.load_state_dict(work.scaler_state)
        self.trainable = [p for p in work.model.parameters() if p.requires_grad]
        self.max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        self.updates = 0
        self.optimizer.register_step_post_hook(self._count)
        self.net = distributed.current().wrap(work.model, work.device)  # DDP under torchrun: all-reduce is timed

    def _count(self, *_: object) -> None:
        self.updates += 1

    def __call__(self) -> None:
        w = self.work
        training.amp_step(
            self.net, w.micro_batches, self.loss_fn, self.optimizer, self.scaler, self.policy, w.device,
            self.max_norm, self.trainable, read_back=False,
        )


def make_step(work: Workload, policy: Policy) -> TrainingStep:
    return TrainingStep(work, policy)


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


@dataclass
class Rounds:
    """Per variant, one value per round: seconds per step, and steps whose update the scaler skipped."""

    times: dict[str, list[float]]
    skipped: dict[str, list[int]]

    def dropped(self) -> list[int]:
        """Rounds in which any variant skipped an update: not comparable, dropped for every variant."""
        n = len(next(iter(self.times.values()), []))
        return [r for r in range(n) if any(s[r] for s in self.skipped.values())]

    def kept_times(self) -> dict[str, list[float]]:
        drop = set(self.dropped())
        return {name: [t for r, t in enumerate(ts) if r not in drop] for name, ts in self.times.items()}


def _updates(step: Callable[[], None]) -> int:
    return getattr(step, "updates", 0)


def interleaved(
    steps_by_variant: dict[str, tuple[Callable[[], None], bool]],
    warmup: int,
    repeats: int,
    steps: int,
    device: torch.device,
) -> Rounds:
    """Seconds per step of each variant, one value per round, and the updates skipped in each round.

    ``steps_by_variant`` maps a name to its step function and whether TF32 is allowed while it runs. Round
    ``r`` runs the variants starting from the ``r``-th, so none is always first (or always after another).
    A step with an ``updates`` counter (``TrainingStep``) reports skipped updates; a plain function none.
    """
    names = list(steps_by_variant)
    for name in names:
        step, tf32 = steps_by_variant[name]
        with precision.tf32(tf32):
            for _ in range(warmup):
                step()
    rounds = Rounds({name: [] for name in names}, {name: [] for name in names})
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, tf32 = steps_by_variant[name]
            before = _updates(step)
            with precision.tf32(tf32):
                rounds.times[name].append(time_steps(step, steps, device))
            counted = hasattr(step, "updates")
            rounds.skipped[name].append(steps - (_updates(step) - before) if counted else 0)
    return rounds


# --- memory -------------------------------------------------------------------------------------------


def peak_memory(step: Callable[[], None], warmup: int, repeats: int, steps: int, device: torch.device) -> dict:
    """Peak memory of ``steps`` steps, per round, in THIS process (call it in a fresh one).

    Returns ``peak`` (bytes: max allocated on a GPU, peak resident set on the CPU), ``baseline`` (the same
    measure just before the round: weights, optimizer state, batch), ``skipped`` (updates the scaler skipped
    in the round: a skipped update allocates no optimizer state, so that round's peak is dropped) and ``method``.
    """
    for _ in range(warmup):
        step()
    peaks: list[float] = []
    baselines: list[float] = []
    skipped: list[int] = []

    def run_steps() -> None:
        before = _updates(step)
        for _ in range(steps):
            step()
        skipped.append(steps - (_updates(step) - before) if hasattr(step, "updates") else 0)

    if device.type == "cuda":
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            baselines.append(float(torch.cuda.memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
            run_steps()
            torch.cuda.synchronize(device)
            peaks.append(float(torch.cuda.max_memory_allocated(device)))
        method = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
        return {"peak": peaks, "baseline": baselines, "skipped": skipped, "method": method}
    if not _reset_peak_rss():
        # No resettable peak (not Linux, or /proc read-only): the process's lifetime peak, one sample.
        run_steps()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"peak": [float(peak)], "baseline": [float("nan")], "skipped": skipped, "method": "getrusage ru_maxrss (process lifetime)"}
    for _ in range(repeats):
        _trim_heap()
        baselines.append(float(_proc_status_bytes("VmRSS")))
        _reset_peak_rss()
        run_steps()
        peaks.append(float(_proc_status_bytes("VmHWM")))
    return {"peak": peaks, "baseline": baselines, "skipped": skipped, "method": "peak resident set (VmHWM) reset via /proc/self/clear_refs"}


def memory_by_variant(params_path: str, params: Params, dtype: str, chosen: list[Variant], device: torch.device) -> dict[str, dict]:
    """Each variant's ``peak_memory`` figures (TF32 stores what FP32 stores: not measured), before any timing.

    GPU: a fresh process per variant (``MemoryProbes``). CPU: here, one variant after the other, each freed
    before the next is built; under torchrun every rank measures, so that DDP's collectives pair up.
    """
    chosen = [v for v in chosen if v.name != "tf32"]
    if device.type == "cuda":
        if not distributed.current().writes:
            return {}  # rank 0 probes, in processes of its own
        with MemoryProbes(params_path, dtype, [v.name for v in chosen]) as probes:
            return probes.collect()
    size, out = sizes(params.bench, device), {}
    for v in chosen:
        work = load_workload(params, device, dtype if v.policy.amp else None)
        step = make_step(work, v.policy)
        with precision.fp32_regions(work.model, v.policy, device), precision.tf32(v.tf32):
            out[v.name] = peak_memory(step, size.warmup, size.repeats, size.steps, device)
        del work, step
        gc.collect()
    return out


class MemoryProbes:
    """``python -m pipeline.benchmark`` once per variant, each in a fresh process, one after the other (so two
    large models never compete for the device's memory), run by ``collect``.
    """

    def __init__(self, params_path: str, dtype: str, names: list[str], cwd: str | Path = ".") -> None:
        self.env = dict(os.environ, **_PROBE_ENV)
        self.cwd = cwd
        self.cmds = {
            n: [sys.executable, "-m", "pipeline.benchmark", "--params", params_path, "--dtype", dtype, "--variant", n]
            for n in names
        }
        self.running: dict[str, subprocess.Popen] = {}

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
            proc = self.running[name] = self._start(name)
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
    by_variant = {name: _without_skipped(m) for name, m in by_variant.items()}
    dropped = {name: m["dropped_rounds"] for name, m in by_variant.items() if m["dropped_rounds"]}
    if dropped:
        out["memory_rounds_dropped"] = dropped
    by_variant = {name: m for name, m in by_variant.items() if m["peak"]}
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


# --- the record ---------------------------------------------------------------------------------------------


def record(
    dtype: str,
    env: dict,
    work: Workload,
    size: Sizes,
    tf32_note: str,
    memory: dict[str, dict],
    rounds: Rounds,
    cpu_load: float | None,
) -> dict:
    """Everything measured, with the method and the workload (``benchmark.json``; not a DVC metric)."""
    params, device = work.params, work.device
    dropped = rounds.dropped()
    times = rounds.kept_times()
    x0, y0 = work.micro_batches[0]
    out = {
        "benchmarked": True,
        "dtype": dtype,
        "env": env,
        "workload": {
            "model": params.task.model,
            "options": params.task.options,
            "parameters": parameter_count(work.model),
            "batch_size": int(y0.shape[0]),
            "micro_batches": len(work.micro_batches),
            "input_shape": list(x0.shape),
            "fp32_modules": list(params.trial.fp32_modules),
            "initial_grad_scaler": work_scaler(work, dtype),
        },
        "method": {
            "warmup": size.warmup,
            "repeats": size.repeats,
            "steps_per_repeat": size.steps,
            "sizing": size.note,
            "clock": "CUDA events, synchronized" if device.type == "cuda" else "time.perf_counter (monotonic)",
            "order": "interleaved, rotating each round",
            "fp32": "strict: TF32 off for matmul and cuDNN",
            "tf32": tf32_note,
            "memory": next(iter(memory.values()))["method"] + (
                "; one fresh process per variant" if device.type == "cuda" else "; in this process, one variant after the other"
            ),
            "skipped_updates": "rounds with an update the GradScaler skipped are dropped for every variant",
            "cpu_threads": torch.get_num_threads(),
            # Other processes on the CPU slow multi-threaded steps unevenly: read wide IQRs in that light.
            "cpu_load_1min": cpu_load,
        },
        "rounds_dropped": {"timed": dropped, "skipped_updates": {n: s for n, s in rounds.skipped.items() if any(s)}},
        "samples": {"seconds_per_step": rounds.times, "memory": memory},
        **memory_summary(memory),
    }
    if times["fp32"]:
        out["seconds_per_step"] = {name: spread(t) for name, t in times.items()}
        out["speedup"] = ratio_spread(times["fp32"], times["amp"])
        if "tf32" in times:
            out["speedup_vs_tf32"] = ratio_spread(times["tf32"], times["amp"])
    else:  # no "speedup" key at all: readers that find one can trust it
        out["no_speedup_because"] = (
            f"every timed round had an update the GradScaler skipped ({len(dropped)} of {size.repeats}); the scale "
            f"had not settled: raise bench.warmup"
        )
    return out


def work_scaler(work: Workload, dtype: str) -> dict | str:
    """The scaler state AMP started from, as recorded (or why there is none)."""
    if dtype != "float16":
        return "none: only float16 uses a GradScaler"
    return work.scaler_state or "fresh: no trial state found"


def short_metrics(result: dict) -> dict:
    """The benchmark's DVC metrics: two numbers (``benchmark.json`` holds the rest)."""
    if not result.get("benchmarked"):
        return {}
    speedup, memory = result.get("speedup"), result.get("memory_ratio")
    return {
        "speedup": speedup["median"] if speedup else None,
        "mem_ratio": memory["median"] if memory else None,
    }


def summary_line(result: dict) -> str:
    dtype, s, m = result["dtype"], result.get("speedup"), result.get("memory_ratio")
    if not result.get("benchmarked"):
        return f"benchmark {dtype}: skipped ({result['reason']})"
    rounds = result["method"]["repeats"] - len(result["rounds_dropped"]["timed"])
    line = f"benchmark {dtype}: " + (
        f"speedup x{s['median']:.2f} (IQR {s['q1']:.2f}-{s['q3']:.2f}, {rounds} rounds)" if s else result["no_speedup_because"]
    )
    if m:
        line += f", peak memory x{m['median']:.2f} of FP32 (IQR {m['q1']:.2f}-{m['q3']:.2f})"
    if result["rounds_dropped"]["timed"]:
        line += f"; {len(result['rounds_dropped']['timed'])} round(s) dropped: the GradScaler skipped an update"
    if result["env"]["backend"] == "cpu":
        line += " [CPU: a short run, not a GPU figure]"
    return line


def _without_skipped(m: dict) -> dict:
    """A probe's figures without its rounds that had a skipped update."""
    skipped = m.get("skipped") or [0] * len(m["peak"])
    keep = [r for r, s in enumerate(skipped) if not s]
    return {
        **m,
        "peak": [m["peak"][r] for r in keep],
        "baseline": [m["baseline"][r] for r in keep],
        "dropped_rounds": [r for r, s in enumerate(skipped) if s],
    }


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
        distributed.shard_only()  # a probe of rank 0 under torchrun: its slice of the batch, in this process alone
        chosen = {v.name: v for v in variants(args.dtype, tuple(params.trial.fp32_modules), devices.describe(device))[0]}
        if args.variant not in chosen:
            raise UserError(f"--variant {args.variant} is not measured on this device; use one of {sorted(chosen)}")
        variant = chosen[args.variant]
        work = load_workload(params, device, args.dtype if variant.policy.amp else None)
        step = make_step(work, variant.policy)
        size = sizes(params.bench, device)
        with precision.fp32_regions(work.model, variant.policy, device), precision.tf32(variant.tf32):
            result = peak_memory(step, size.warmup, size.repeats, size.steps, device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
