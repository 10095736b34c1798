"""Stage publish: mirror every stage's results to MLflow (idempotent; DVC outputs stay the source of truth)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from pipeline import paths, tracking
from pipeline.artifacts import read_json, sha256_file
from pipeline.config import load_params


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    env = manifest["env"]
    dtypes = params.trial.dtypes
    published = [paths.REF_MANIFEST, paths.REF_TRAJECTORY]
    for d in dtypes:
        published += [paths.trial(d) / "manifest.json", paths.compare(d) / "stats.json", paths.decision(d) / "decision.json", paths.benchmark(d) / "benchmark.json"]
    content = {str(p): sha256_file(p) for p in published if p.is_file()}
    key = hashlib.sha256(json.dumps({"ref": manifest["run_key"], "commit": tracking.git_commit(), "content": content}, sort_keys=True).encode()).hexdigest()

    pub = tracking.Publisher(params.tracking.experiment)
    common = {"git_commit": tracking.git_commit(), "backend": env["backend"], "device_name": env["device_name"], "torch_version": env["torch"], "rule_sha256": manifest["rule_sha256"]}
    if tracking.dvc_experiment_name():
        common["dvc_experiment"] = tracking.dvc_experiment_name()
    flat = _flatten(asdict(params))
    parent = pub.run(key, f"amp-validation {key[:8]}", {**common, "stage": "pipeline"}, params=flat)
    ref_steps = read_json(paths.REF_TRAJECTORY)["steps"]
    pub.run(f"{key}/freeze", "freeze", {**common, "stage": "freeze", "dtype": "float32"},
            step_metrics={"loss_fp32": [(s["step"], s["loss"]) for s in ref_steps]}, artifacts=[paths.REF_MANIFEST], parent=parent)
    for d in dtypes:
        decision = read_json(paths.decision(d) / "decision.json", f"decide@{d}")
        steps = read_json(paths.trial(d) / "trajectory.json", f"trial@{d}")["steps"]
        tags = {**common, "dtype": d, "decision": decision["decision"], "reasons_count": str(len(decision["reasons"]))}
        pub.run(f"{key}/trial@{d}", f"trial@{d}", {**tags, "stage": "trial"}, parent=parent, step_metrics={
            "loss_fp32": [(s["step"], s["loss"]) for s in ref_steps],
            "loss_amp": [(s["step"], s["loss"]) for s in steps],
            "loss_scale": [(s["step"], s["scale"]) for s in steps],
            "grad_norm": [(s["step"], s["grad_norm"]) for s in steps],
            "skipped": [(s["step"], float(s["skipped"])) for s in steps],
        })
        pub.run(f"{key}/compare@{d}", f"compare@{d}", {**tags, "stage": "compare"}, parent=parent,
                metrics=read_json(paths.compare_metrics(d)), artifacts=[paths.compare(d) / "cases.json", paths.compare(d) / "stats.json"])
        pub.run(f"{key}/decide@{d}", f"decide@{d}", {**tags, "stage": "decide"}, parent=parent,
                params={f"reason.{i}": r for i, r in enumerate(decision["reasons"])}, artifacts=[paths.decision(d) / "decision.json"])
        bench = read_json(paths.benchmark(d) / "benchmark.json", f"benchmark@{d}")
        bench_metrics = {}
        if bench.get("benchmarked"):
            bench_metrics = {"speedup_median": bench["speedup"]["median"], **{f"seconds_per_step.{k}": v["median"] for k, v in bench["seconds_per_step"].items()}}
        pub.run(f"{key}/benchmark@{d}", f"benchmark@{d}", {**tags, "stage": "benchmark"}, parent=parent,
                metrics=bench_metrics, artifacts=[paths.benchmark(d) / "benchmark.json"])
    print(f"publish: {pub.created} run(s) created, {pub.skipped} already there, at {pub.uri}")


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}
