"""Stage report: the figures of the report, per variant, and the flat curves that `dvc plots` draws.

Deterministic, like every DVC output but the benchmark: it reads no timing. The HTML report, which
quotes the benchmark, is assembled from these figures by publish and lives in MLflow. Outputs are read
with safetensors' numpy loader: this stage never imports torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline import paths, plots
from pipeline.artifacts import read_json, sha256_file, write_bytes, write_json
from pipeline.config import load_params
from pipeline.errors import UserError


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    ref_steps = read_json(paths.REF_TRAJECTORY, "freeze")["steps"]
    ref_out = _outputs(paths.REF_OUTPUTS, manifest["files"][str(paths.REF_OUTPUTS)], "freeze")
    written: set[Path] = set()
    for d in params.trial.dtypes:
        trial_manifest = read_json(paths.trial(d) / "manifest.json", f"trial@{d}")
        steps = read_json(paths.trial(d) / "trajectory.json", f"trial@{d}")["steps"]
        trial_out = _outputs(paths.trial(d) / "outputs.safetensors", trial_manifest["files"]["outputs.safetensors"], f"trial@{d}")
        stats = read_json(paths.compare(d) / "stats.json", f"compare@{d}")
        figures = {
            "loss": plots.loss_curves(ref_steps, steps, d),
            "scale": plots.loss_scale(steps, d),
            "scores": plots.scores(ref_out, trial_out, d),
            "errors": plots.error_histogram(ref_out, trial_out, {n: g["atol"] for n, g in stats["values"].items()}, d),
        }
        for name, png in figures.items():
            write_bytes(paths.report_plot(d, name), png)
            written.add(paths.report_plot(d, name))
        for family, rows in plots.curve_rows(ref_steps, steps).items():
            write_json(paths.report_curve(family, d), rows)
            written.add(paths.report_curve(family, d))
    _prune(paths.REPORT, written)
    print(f"report: {len(written)} figure and curve file(s) under {paths.REPORT} for {', '.join(params.trial.dtypes)}")


def _outputs(path: Path, expected_sha256: str, produced_by: str) -> dict[str, np.ndarray]:
    """Named output arrays of a safetensors file, after checking it is the one its manifest names.

    Raises:
        UserError: missing or replaced file.
    """
    from safetensors.numpy import load_file

    if not path.is_file():
        raise UserError(f"{path} not found; run `dvc repro {produced_by}` first")
    if sha256_file(path) != expected_sha256:
        raise UserError(f"{path} differs from its manifest (sha256); restore it with `dvc checkout` or rerun `dvc repro {produced_by}`")
    return load_file(str(path))


def _prune(folder: Path, keep: set[Path]) -> None:
    """Remove what an earlier run left for dtypes no longer configured (the folder belongs to this stage)."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file() and path not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
