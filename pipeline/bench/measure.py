"""The whole benchmark of one accepted variant: memory first, then the interleaved timings, then the record."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch

from pipeline import devices, distributed, precision, transforms
from pipeline.artifacts import comparison
from pipeline.artifacts.benchmark import (
    AMP, FP32, FP32_AGAIN, TF32, Benchmark, MemoryProbe, Method, RoundsDropped, Samples, WorkloadFacts,
)
from pipeline.bench.memory import memory_by_arm
from pipeline.bench.sizing import Sizes, sizes
from pipeline.bench.stats import memory_summary, ratio_spread, speed, spread, time_to_quality
from pipeline.bench.timing import Rounds, interleaved
from pipeline.bench.arms import arms, timed_arms
from pipeline.bench.workload import Workload, forward_param_dtypes, load_workload, step_for
from pipeline.config import Params
from pipeline.config import Policy


def measure(params_path: str, params: Params, variant: str, device: torch.device) -> Benchmark | None:
    """Time and memory of FP32 (and TF32) against trial ``variant``'s policy, with FP32 timed again beside them (the
    A/A), and the time to FP32's final loss (the updates compare counted to it, times the step times); None on a rank
    other than 0 (it only takes part, so that DDP's or FSDP2's collectives pair up). Under FSDP2 every arm trains
    sharded, as the trials do (``workload.TrainingStep``).

    Raises:
        UserError: the device cannot run the variant's dtype, or an earlier stage (compare@NAME among them) has not run.
    """
    precision.strict_fp32()
    world = distributed.current()
    reach = comparison.read(variant).training.updates_to_fp32_loss  # before any timing: compare@NAME must have run
    policy = params.trial.policy(variant)
    if policy.amp:
        devices.check_dtype_supported(device, precision.parse_dtype(policy.dtype))
    env = devices.describe(device)
    chosen, tf32_note = arms(policy, env)
    size = sizes(params.bench, device.type)
    memory = memory_by_arm(params_path, params, variant, chosen, device)  # before any timing
    with contextlib.ExitStack() as stack:
        steps, works = {}, {}
        for a in timed_arms(chosen):  # each arm its own model (under FSDP2 its own shards), optimizer and scaler
            works[a.name] = load_workload(params, device, variant if a.name == AMP else None)
            steps[a.name] = (step_for(works[a.name], a.policy), a.tf32)
            stack.enter_context(precision.fp32_regions(steps[a.name][0].model, a.policy, device))
        trial_step = steps[AMP][0]
        compiled = transforms.compile_seconds(trial_step, device) if policy.compiled else None  # before any timed round
        fsdp = fsdp_words(world, forward_param_dtypes(trial_step), bool(params.reference.train_steps)) \
            if world.sharded else None  # an untimed step
        load = os.getloadavg()[0] if device.type == "cpu" else None
        rounds = interleaved(steps, size.warmup, size.repeats, size.steps, device)
    if not world.writes:
        return None
    out = record(variant, policy, env.as_dict(), works[AMP], size, tf32_note, memory, rounds, load, fsdp)
    if out.speed is not None and reach is not None:  # the time to FP32's final loss: the updates it took x the step times
        out = replace(out, speed=replace(out.speed, to_quality=time_to_quality(out.speed.speedup, reach)))
    return replace(out, compile_seconds=compiled, **_unquoted(trial_step.applied))


def fsdp_words(world: distributed.World, amp_dtypes: tuple[str, ...], trains: bool = True) -> str:
    """The record's words for what FSDP2 did in every timed step (``Method.fsdp``); ``trains`` False: an inference-only
    benchmark, where FSDP2 shards nothing."""
    if not trains:
        return (f"FSDP2 on {world.size} ranks ({world.backend}) shards training only: inference runs the whole model, as the "
                f"trial infers; the amp arm's parameters in its forward: {', '.join(amp_dtypes)}")
    blocks = ", ".join(world.blocks) or "each top-level child with parameters"
    return (f"FSDP2 (fully_shard) on {world.size} ranks ({world.backend}), as the trials train: every arm a sharded copy "
            f"(blocks: {blocks}; then the root), its optimizer on the shards, the GradScaler's skip agreed over the ranks; "
            f"no whole model kept beside the shards; the amp arm's parameters in its forward: {', '.join(amp_dtypes)}")


def _unquoted(applied: transforms.Applied) -> dict:
    """Emulated float8 runs the casts in software: its times are kept, but no speedup is quoted from them."""
    if applied.float8_kernels != "emulated":
        return {}
    return dict(
        speedup=None, speedup_vs_tf32=None, speed=None,
        no_speedup_because="float8 ran emulated (no FP8 kernels on this device): its times are kept, no speedup is quoted",
    )


def record(
    variant: str,
    policy: Policy,
    env: dict,
    work: Workload,
    size: Sizes,
    tf32_note: str,
    memory: dict[str, MemoryProbe],
    rounds: Rounds,
    cpu_load: float | None,
    fsdp: str | None = None,
) -> Benchmark:
    """Everything measured, with the method, the workload and the speed verdict (when ``rounds`` timed the A/A arm).
    ``fsdp``: what FSDP2 did (``fsdp_words``); None: no FSDP2."""
    device = work.device
    dropped, times = rounds.dropped(), rounds.kept_times()
    memory_method = next(iter(memory.values())).method
    timed = bool(times[FP32])
    return Benchmark(
        variant=variant,
        env=env,
        workload=workload_facts(work, policy),
        method=Method(
            warmup=size.warmup,
            repeats=size.repeats,
            steps_per_repeat=size.steps,
            sizing=size.note,
            clock="CUDA events, synchronized" if device.type == "cuda" else "time.perf_counter (monotonic)",
            order="interleaved, rotating each round",
            timed=(None if work.params.reference.train_steps else
                   "inference: one forward pass of the first update's batches, no gradients (reference.train_steps 0)"),
            fp32="strict: TF32 off for matmul and cuDNN; timed twice (fp32_again, the A/A: its own model, same rounds)",
            tf32=tf32_note,
            memory=memory_method + _where_memory(device, fsdp is not None),
            skipped_updates="rounds with an update the GradScaler skipped are dropped for every arm",
            cpu_threads=torch.get_num_threads(),
            cpu_load_1min=cpu_load,
            fsdp=fsdp,
        ),
        rounds_dropped=RoundsDropped(tuple(dropped), {n: tuple(s) for n, s in rounds.skipped.items() if any(s)}),
        samples=Samples({n: tuple(t) for n, t in rounds.times.items()}, memory),
        memory=memory_summary(memory),
        seconds_per_step={name: spread(t) for name, t in times.items()} if timed else None,
        speedup=ratio_spread(times[FP32], times[AMP]) if timed else None,
        speedup_vs_tf32=ratio_spread(times[TF32], times[AMP]) if timed and TF32 in times else None,
        speed=speed(times) if timed and FP32_AGAIN in times else None,
        no_speedup_because=None if timed else (
            f"every timed round had an update the GradScaler skipped ({len(dropped)} of {size.repeats}); the scale "
            f"had not settled: raise bench.warmup"
        ),
    )


def _where_memory(device: torch.device, sharded: bool) -> str:
    if device.type != "cuda":
        return "; in this process, one arm after the other"
    if sharded:  # a probe's process of its own has no process group: FSDP2 could not shard there
        return "; under FSDP2 in each rank's process, one arm after the other, freed between arms; rank 0's figures"
    return "; one fresh process per arm"


def workload_facts(work: Workload, policy: Policy) -> WorkloadFacts:
    """The workload as recorded, with the scaler state AMP started from (or why there is none)."""
    params = work.params
    x0, y0 = work.micro_batches[0]
    if not policy.uses_scaler:
        scaler = "none: only float16 uses a GradScaler"
    else:
        scaler = work.scaler_state or "fresh: no trial state found"
    return WorkloadFacts(
        model=params.task.model,
        options=params.task.options,
        parameters=work.parameters,
        batch_size=int(y0.shape[0]),
        micro_batches=len(work.micro_batches),
        input_shape=tuple(x0.shape),
        fp32_modules=policy.fp32_modules,
        initial_grad_scaler=scaler,
    )
