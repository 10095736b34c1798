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
    noise = _replicate_steps()
    ref_out, ids = _outputs(paths.REF_OUTPUTS, manifest["files"][str(paths.REF_OUTPUTS)], "freeze")
    band = (params.acceptance.loss_atol, params.acceptance.loss_rtol)
    written: set[Path] = set()
    for d in params.trial.dtypes:
        trial_manifest = read_json(paths.trial(d) / "manifest.json", f"trial@{d}")
        steps = read_json(paths.trial(d) / "trajectory.json", f"trial@{d}")["steps"]
        trial_out, _ = _outputs(paths.trial(d) / "outputs.safetensors", trial_manifest["files"]["outputs.safetensors"], f"trial@{d}")
        stats = read_json(paths.compare(d) / "stats.json", f"compare@{d}")
        flipped_ids = {f["id"] for f in stats["flips"]["flip_list"]}
        flipped = np.array([i in flipped_ids for i in ids], dtype=bool) if ids else None
        tolerances = {n: (g.get("atol", 0.0), g.get("rtol", 0.0)) for n, g in stats["values"].items()}
        figures = {
            "loss": plots.loss_curves(ref_steps, steps, d, band, noise),
            "scale": plots.loss_scale(steps, d),
            "envelope": plots.error_envelope(ref_out, trial_out, tolerances, d, flipped),
            "errors": plots.error_histogram(ref_out, trial_out, {n: t[0] for n, t in tolerances.items()}, d),
        }
        for name, png in figures.items():
            write_bytes(paths.report_plot(d, name), png)
            written.add(paths.report_plot(d, name))
        for family, rows in plots.curve_rows(ref_steps, steps, d, band, noise).items():
            write_json(paths.report_curve(family, d), rows)
            written.add(paths.report_curve(family, d))
    for folder in (paths.REPORT / "plots", paths.REPORT_CURVES):  # the stage's two outputs (DVC's .gitignore sits beside)
        _prune(folder, written)
    print(f"report: {len(written)} figure and curve file(s) under {paths.REPORT} for {', '.join(params.trial.dtypes)}")


def _replicate_steps() -> list[dict] | None:
    """The FP32 replicate's trajectory (the noise floor), when freeze wrote one."""
    path = getattr(paths, "REF_REPLICATE_TRAJECTORY", None)
    if path is None or not Path(path).is_file():
        return None
    return read_json(path, "freeze")["steps"]


def _outputs(path: Path, expected_sha256: str, produced_by: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Named output arrays of a safetensors file and its case ids (metadata ``ids``), after checking it is
    the one its manifest names.

    Raises:
        UserError: missing or replaced file.
    """
    import json

    from safetensors import safe_open

    if not path.is_file():
        raise UserError(f"{path} not found; run `dvc repro {produced_by}` first")
    if sha256_file(path) != expected_sha256:
        raise UserError(f"{path} differs from its manifest (sha256); restore it with `dvc checkout` or rerun `dvc repro {produced_by}`")
    with safe_open(str(path), framework="np") as handle:
        ids = json.loads((handle.metadata() or {}).get("ids", "[]"))
        return {name: handle.get_tensor(name) for name in handle.keys()}, ids


def _prune(folder: Path, keep: set[Path]) -> None:
    """Remove what an earlier run left for dtypes no longer configured (the folder belongs to this stage)."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file() and path not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
