"""Stage benchmark@DTYPE: time per training step and peak memory, strict FP32 (and TF32) vs AMP, accepted variants only.

pipeline/benchmark.py holds the method; this stage picks the variants, measures each one's memory in its
own process, times them all interleaved in this process, and writes the figures.
"""

from __future__ import annotations

import contextlib
import os

import torch

from pipeline import benchmark, devices, paths, precision
from pipeline.artifacts import read_json, write_json
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    decision = read_json(paths.decision(dtype) / "decision.json", f"decide@{dtype}")
    out = paths.benchmark(dtype) / "benchmark.json"
    if decision["decision"] != "accept":
        write_json(
            out,
            {"benchmarked": False, "dtype": dtype, "reason": f"{dtype} was rolled back; only accepted variants are benchmarked"},
        )
        print(f"benchmark {dtype}: skipped (rolled back)")
        return
    device = devices.resolve(params.device)
    devices.check_dtype_supported(device, precision.parse_dtype(dtype))
    env = devices.describe(device)
    chosen, tf32_note = benchmark.variants(dtype, tuple(params.trial.fp32_modules), env)
    bench = params.bench
    # TF32 stores the same tensors as FP32: its memory is not measured again.
    probe_names = [v.name for v in chosen if v.name != "tf32"]

    with (
        benchmark.MemoryProbes(params_path, dtype, probe_names, parallel=device.type == "cpu") as probes,
        contextlib.ExitStack() as stack,
    ):
        steps, works = {}, []
        for v in chosen:  # each variant its own model, optimizer and scaler
            work = benchmark.load_workload(params, device)
            stack.enter_context(precision.fp32_regions(work.model, v.policy, device))
            steps[v.name] = (benchmark.make_step(work, v.policy), v.tf32)
            works.append(work)
        memory = probes.collect()  # before timing: nothing else may run while the clock does
        load = os.getloadavg()[0] if device.type == "cpu" else None
        times = benchmark.interleaved(steps, bench.warmup, bench.repeats, bench.steps, device)

    result = {
        "benchmarked": True,
        "dtype": dtype,
        "env": env,
        "workload": {
            "model": params.task.model,
            "options": params.task.options,
            "parameters": benchmark.parameter_count(works[0].model),
            "batch_size": int(works[0].x.shape[0]),
            "input_shape": list(works[0].x.shape),
            "fp32_modules": list(params.trial.fp32_modules),
        },
        "method": {
            "warmup": bench.warmup,
            "repeats": bench.repeats,
            "steps_per_repeat": bench.steps,
            "clock": "CUDA events, synchronized" if device.type == "cuda" else "time.perf_counter (monotonic)",
            "order": "interleaved, rotating each round",
            "fp32": "strict: TF32 off for matmul and cuDNN",
            "tf32": tf32_note,
            "memory": memory["fp32"]["method"] + "; one fresh process per variant",
            "cpu_threads": torch.get_num_threads(),
            # Other processes on the CPU slow multi-threaded steps unevenly: read wide IQRs in that light.
            "cpu_load_1min": load,
        },
        "seconds_per_step": {name: benchmark.spread(t) for name, t in times.items()},
        "speedup": benchmark.ratio_spread(times["fp32"], times["amp"]),
        **benchmark.memory_summary(memory),
        "samples": {"seconds_per_step": times, "memory": memory},
    }
    if "tf32" in times:
        result["speedup_vs_tf32"] = benchmark.ratio_spread(times["tf32"], times["amp"])
    write_json(out, result)
    s, m = result["speedup"], result.get("memory_ratio")
    line = f"benchmark {dtype}: speedup x{s['median']:.2f} (IQR {s['q1']:.2f}-{s['q3']:.2f}, {bench.repeats} rounds)"
    if m:
        line += f", peak memory x{m['median']:.2f} of FP32 (IQR {m['q1']:.2f}-{m['q3']:.2f})"
    print(line)
