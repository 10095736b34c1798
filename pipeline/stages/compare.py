"""Stage compare@DTYPE: value gaps, decision flips, quality and training gap of one trial."""

from __future__ import annotations

from pipeline import comparison, paths, reference
from pipeline.artifacts import read_json, read_tensors, write_json
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    ref = reference.load(params)
    trial_dir = paths.trial(dtype)
    manifest = read_json(trial_dir / "manifest.json", f"trial@{dtype}")
    files = manifest["files"]
    trial_out = read_tensors(trial_dir / "outputs.safetensors", files["outputs.safetensors"], f"trial@{dtype}")[0]
    trained_out = read_tensors(trial_dir / "trained_outputs.safetensors", files["trained_outputs.safetensors"], f"trial@{dtype}")[0]
    trajectory = read_json(trial_dir / "trajectory.json", f"trial@{dtype}")
    stats = comparison.compare(
        params.task.kind, params.acceptance, ref.cases, ref.outputs, trial_out, trained_out,
        ref.trajectory, trajectory["steps"], trajectory["final_scale"], ref.outputs_fp64(), trajectory.get("scaler_enabled", True),
    )
    stats["env_differs_from_reference"] = manifest["env_differs_from_reference"]
    out = paths.compare(dtype)
    write_json(out / "stats.json", stats)
    write_json(paths.compare_metrics(dtype), comparison.summary(stats))
    write_json(out / "cases.json", comparison.case_table(ref.cases, ref.outputs, trial_out, stats))
    f = stats["flips"]
    print(f"compare {dtype}: {f['flips']} flip(s), {f['boundary_flips']}/{f['boundary_cases']} boundary flip(s); quality {stats['quality']}")
