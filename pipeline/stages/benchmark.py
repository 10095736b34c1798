"""Stage benchmark@DTYPE: time per training step and peak memory, FP32 vs AMP, for accepted variants only."""

from __future__ import annotations

from pipeline import benchmark, checkpoint, devices, paths, task, training
from pipeline.artifacts import read_json, read_tensors, write_json
from pipeline.config import load_params
from pipeline.precision import Policy


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    decision = read_json(paths.decision(dtype) / "decision.json", f"decide@{dtype}")
    out = paths.benchmark(dtype) / "benchmark.json"
    if decision["decision"] != "accept":
        write_json(out, {"benchmarked": False, "reason": f"{dtype} was rolled back; only accepted variants are benchmarked"})
        print(f"benchmark {dtype}: skipped (rolled back)")
        return
    device = devices.resolve(params.device)
    train_t, _ = read_tensors(paths.PREPARED_TRAIN, produced_by="prepare")
    idx = training.batch_order(train_t["x"].shape[0], params.reference.batch_size, 1, params.seed)[0]
    x, y = train_t["x"][idx].to(device), train_t["y"][idx].to(device)
    loss_fn = training.loss_function(params.task.loss)
    variants = {}
    for name, policy in (("fp32", Policy()), ("amp", Policy(dtype=dtype, fp32_modules=tuple(params.trial.fp32_modules)))):
        model = task.build_model(params.task, params.seed).to(device).train()
        checkpoint.restore(checkpoint.load(paths.REF_INIT), model, rng=False)
        variants[name] = benchmark.make_step(model, x, y, lambda o, t: loss_fn(task.primary(task.named_outputs(o)), t), params.reference.lr, policy, device)
    times = benchmark.interleaved(variants, params.bench.warmup, params.bench.repeats, params.bench.steps, device)
    result = {
        "benchmarked": True,
        "dtype": dtype,
        "env": devices.describe(device),
        "batch_size": int(x.shape[0]),
        "seconds_per_step": {name: benchmark.spread(t) for name, t in times.items()},
        "speedup": benchmark.ratio_spread(times["fp32"], times["amp"]),
        "repeats": params.bench.repeats,
        "steps_per_repeat": params.bench.steps,
    }
    write_json(out, result)
    print(f"benchmark {dtype}: speedup x{result['speedup']['median']:.2f} (IQR {result['speedup']['q1']:.2f}-{result['speedup']['q3']:.2f})")
