"""Stage benchmark@DTYPE: time per training step and peak memory, strict FP32 (and TF32) vs AMP, accepted variants only.

pipeline/benchmark.py holds the method; this stage picks the variants, measures each one's memory (in its
own process on a GPU), then times them all interleaved in this process, and writes the record
(``benchmark.json``) and its two DVC metrics (``data/metrics/bench-DTYPE.json``: speedup (median), mem_ratio).
"""

from __future__ import annotations

import contextlib
import os

from pipeline import benchmark, devices, distributed, paths, precision

from pipeline.artifacts import decision
from pipeline.files import write_json
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    out = paths.benchmark(dtype)
    device = distributed.init(devices.resolve(params.device))  # one process: unchanged; under torchrun: this rank's
    world = distributed.current()
    if not decision.read(dtype).accepted:
        result = {"benchmarked": False, "dtype": dtype, "reason": f"{dtype} was rolled back; only accepted variants are benchmarked"}
    else:
        precision.strict_fp32()
        devices.check_dtype_supported(device, precision.parse_dtype(dtype))
        env = devices.describe(device)
        chosen, tf32_note = benchmark.variants(dtype, tuple(params.trial.fp32_modules), env)
        size = benchmark.sizes(params.bench, device)
        memory = benchmark.memory_by_variant(params_path, params, dtype, chosen, device)  # before any timing
        with contextlib.ExitStack() as stack:
            steps, works = {}, []
            for v in chosen:  # each variant its own model, optimizer and scaler
                works.append(benchmark.load_workload(params, device, dtype if v.policy.amp else None))
                stack.enter_context(precision.fp32_regions(works[-1].model, v.policy, device))
                steps[v.name] = (benchmark.make_step(works[-1], v.policy), v.tf32)
            load = os.getloadavg()[0] if device.type == "cpu" else None
            rounds = benchmark.interleaved(steps, size.warmup, size.repeats, size.steps, device)
        if not world.writes:
            return  # rank 0 alone records and writes
        result = benchmark.record(dtype, env, works[-1], size, tf32_note, memory, rounds, load)
    if not world.writes:
        return  # (a rolled-back variant: rank 0 writes the note)
    write_json(out / "benchmark.json", result)
    write_json(paths.benchmark_metrics(dtype), benchmark.short_metrics(result))
    print(benchmark.summary_line(result))
