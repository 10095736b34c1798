#!/usr/bin/env python3
"""Where a training step's time goes, strict FP32 (and TF32) against AMP: what to read when AMP's speedup
falls short of the hardware's ratio (issue 12: on an H200, bf16 dense ~790 TFLOP/s against ~67 for FP32).

    python3 scripts/gpu_profile.py OUT [--size gpu|cpu|tiny] [--dtype bfloat16|float16] [--steps 10]

The workload is gpu_check's transformer (``_project.transformer``) at ``--size`` (default: gpu when a GPU is visible), one
batch, the benchmark's own step (``bench.workload.TrainingStep``: ``training.amp_step``, nothing read back).
For each variant: median time per step over ``--steps`` steps after a warm-up, the FLOP rate it reaches
(6 x parameters x tokens, plus attention), peak GPU memory of the step, and a ``torch.profiler`` table of
the ops that took the most device time. Writes OUT/profile.json and OUT/profile.md. A memory-bound op
(normalisation, softmax, elementwise, the optimizer's FP32 update) high in the AMP table is what keeps the
speedup below the tensor-core ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402
import _project  # noqa: E402

from pipeline import devices, precision  # noqa: E402
from pipeline.bench.timing import time_steps  # noqa: E402
from pipeline.bench.arms import arms  # noqa: E402
from pipeline.config import Policy  # noqa: E402
from pipeline.bench.workload import TrainingStep, Workload  # noqa: E402
from pipeline.config import DTYPES, Params, build  # noqa: E402
from pipeline.examples import transformer  # noqa: E402
from pipeline.compare.quantiles import quantile  # noqa: E402


def workload(size: str, device: torch.device) -> tuple[Params, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The transformer of gpu_check at ``size``, its recipe, and one training batch on ``device``."""
    example = _project.transformer(size)
    options, recipe = example["task"]["options"], example["reference"]
    params = build(
        Params,
        {
            "task": {
                "model": "pipeline.examples.transformer:build_model",
                "data": "pipeline.examples.transformer:load_data",
                "options": options,
            },
            "reference": recipe,
        },
        "",
    )
    data = transformer.load_data(**{**options, "n_train": recipe["batch_size"], "n_eval": 1})
    torch.manual_seed(0)
    model = transformer.build_model(**options)
    return params, model, data["train_x"].to(device), data["train_y"].to(device)


def step_flops(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Forward + backward FLOPs of one step: 6 per weight per token, plus attention's two T x T products."""
    tokens = x.numel()
    dense = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("embed", "pos")))
    blocks = getattr(model, "blocks", [])
    d_model = model.head.in_features if hasattr(model, "head") else 0
    attention = 2 * 2 * x.shape[0] * x.shape[1] ** 2 * d_model * len(blocks)
    return 6.0 * dense * tokens + 3.0 * attention


def profile_variant(step, device: torch.device, steps: int, tf32: bool) -> dict:
    """Median seconds per step, peak GPU memory, and the top ops by device (or CPU) time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with precision.tf32(tf32):
        for _ in range(3):
            step()
        times = [time_steps(step, 1, device) for _ in range(steps)]
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    if device.type == "cuda" and not hasattr(events[0], key):  # torch < 2.4 names it after CUDA
        key = "self_cuda_time_total"
    total = sum(getattr(e, key) for e in events) or 1.0
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:15]
    return {
        "seconds_per_step": quantile(times, 0.5),
        "seconds_q1_q3": [quantile(times, 0.25), quantile(times, 0.75)],
        "peak_memory_bytes": peak,
        "top_ops": [
            {"op": e.key, "calls": e.count // 2, "share": getattr(e, key) / total, "us_per_step": getattr(e, key) / 2}
            for e in top
        ],
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Step profile: {result['env']['device_name']} ({result['env']['backend']}), torch {result['env']['torch']}",
        "",
        f"transformer size `{result['size']}`, {result['parameters'] / 1e6:.1f}M parameters, batch {result['batch']}, "
        f"{result['flops_per_step'] / 1e12:.3g} TFLOP per step",
        "",
        "| variant | ms/step (median) | TFLOP/s reached | peak memory | speedup vs fp32 |",
        "|---|---|---|---|---|",
    ]
    base = result["variants"]["fp32"]["seconds_per_step"]
    for name, v in result["variants"].items():
        peak = f"{v['peak_memory_bytes'] / 2**30:.2f} GiB" if v["peak_memory_bytes"] else "-"
        lines.append(
            f"| {name} | {1000 * v['seconds_per_step']:.2f} | {result['flops_per_step'] / v['seconds_per_step'] / 1e12:.3g} | "
            f"{peak} | x{base / v['seconds_per_step']:.2f} |"
        )
    for name, v in result["variants"].items():
        lines += [
            "",
            f"## {name}: ops by {'device' if result['env']['backend'] != 'cpu' else 'CPU'} time",
            "", "| op | calls/step | share | us/step |", "|---|---|---|---|",
        ]
        lines += [f"| `{o['op']}` | {o['calls']} | {100 * o['share']:.1f}% | {o['us_per_step']:.0f} |" for o in v["top_ops"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("gpu", "cpu", "tiny"))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    device = devices.resolve("auto")
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    env = devices.describe(device)
    params, model, x, y = workload(size, device)
    chosen, _ = arms(Policy(dtype=args.dtype), env)
    result = {
        "env": env.as_dict(),
        "size": size,
        "dtype": args.dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": list(x.shape),
        "flops_per_step": step_flops(model, x),
        "variants": {},
    }
    for v in chosen:
        work = Workload(copy.deepcopy(model).to(device).train(), [(x, y)], params, device, {})
        result["variants"][v.name] = profile_variant(TrainingStep(work, v.policy), device, args.steps, v.tf32)
        del work
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    (args.out / "profile.md").write_text(markdown(result))
    print(markdown(result).split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
