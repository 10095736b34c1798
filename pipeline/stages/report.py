"""Stage report: the figures of the report, per variant, and the flat curves that `dvc plots` draws.

Deterministic, like every DVC output but the benchmark: it reads no timing. The HTML report, which
quotes the benchmark, is assembled from these figures by publish and lives in MLflow. Outputs are read
with safetensors' numpy loader: this stage never imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline import paths

from pipeline.present import plots
from pipeline.files import check_inside_repository, read_json, sha256_file, write_bytes, write_json
from pipeline.config import DTYPES, load_params
from pipeline.errors import UserError


MAX_ELEMENTS = 2_000_000
"""Most output elements the figures read per file (16 MB in float32). Above it (a language model's logits
over a large fixed set), they draw an evenly spaced subset of cases plus every flipped one, and say so in
their titles; the counts that decide are compare's, exact, in stats.json."""


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    ref_steps = read_json(paths.REF_TRAJECTORY, "freeze")["steps"]
    noise = _replicate_steps()
    _verify(paths.REF_OUTPUTS, manifest["files"][str(paths.REF_OUTPUTS)], "freeze")
    ids, per_case = _layout(paths.REF_OUTPUTS)
    band = (params.acceptance.loss_atol, params.acceptance.loss_rtol)
    written: set[Path] = set()
    for d in params.trial.dtypes:
        trial_manifest = read_json(paths.trial(d) / "manifest.json", f"trial@{d}")
        steps = read_json(paths.trial(d) / "trajectory.json", f"trial@{d}")["steps"]
        trial_file = paths.trial(d) / "outputs.safetensors"
        _verify(trial_file, trial_manifest["files"]["outputs.safetensors"], f"trial@{d}")
        stats = read_json(paths.compare(d) / "stats.json", f"compare@{d}")
        flipped_ids = {f["id"] for f in stats["flips"]["flip_list"]}
        flipped_rows = [i for i, case in enumerate(ids) if case in flipped_ids]
        rows, note = _sample(len(ids), per_case, flipped_rows)
        ref_out, trial_out = _read(paths.REF_OUTPUTS, rows), _read(trial_file, rows)
        chosen = np.arange(len(ids)) if rows is None else rows
        flipped = np.isin(chosen, flipped_rows) if ids else None
        tolerances = {n: (g.get("atol", 0.0), g.get("rtol", 0.0)) for n, g in stats["values"].items()}
        figures = {
            "loss": plots.loss_curves(ref_steps, steps, d, band, noise),
            "scale": plots.loss_scale(steps, d),
            "envelope": plots.error_envelope(ref_out, trial_out, tolerances, d, flipped, note),
            "errors": plots.error_histogram(ref_out, trial_out, {n: t[0] for n, t in tolerances.items()}, d, note),
        }
        for name, png in figures.items():
            write_bytes(paths.report_plot(d, name), png)
            written.add(paths.report_plot(d, name))
        for family, curve in plots.curve_rows(ref_steps, steps, d, band, noise).items():
            write_json(paths.report_curve(family, d), curve)
            written.add(paths.report_curve(family, d))
    for folder, owned in ((paths.REPORT / "plots", _own_plot), (paths.REPORT_CURVES, _own_curve)):  # the stage's two outputs
        _prune(folder, written, owned)
    print(f"report: {len(written)} figure and curve file(s) under {paths.REPORT} for {', '.join(params.trial.dtypes)}")


def _sample(n: int, per_case: int, flipped_rows: list[int]) -> tuple[np.ndarray | None, str]:
    """Every case (None) when the outputs fit MAX_ELEMENTS, else evenly spaced cases plus the flipped ones."""
    if n * per_case <= MAX_ELEMENTS:
        return None, ""
    spaced = np.linspace(0, n - 1, max(1, MAX_ELEMENTS // max(per_case, 1))).astype(np.int64)
    rows = np.union1d(spaced, np.asarray(flipped_rows, dtype=np.int64))
    return rows, f"{len(rows)} of {n} cases drawn (evenly spaced, every flipped one)"


def _replicate_steps() -> list[dict] | None:
    """The FP32 replicate's trajectory (the noise floor), when freeze wrote one."""
    path = getattr(paths, "REF_REPLICATE_TRAJECTORY", None)
    if path is None or not Path(path).is_file():
        return None
    return read_json(path, "freeze")["steps"]


def _verify(path: Path, expected_sha256: str, produced_by: str) -> None:
    """Raises: UserError when the file is missing or is not the one its manifest names."""
    if not path.is_file():
        raise UserError(f"{path} not found; run `dvc repro {produced_by}` first")
    if sha256_file(path) != expected_sha256:
        raise UserError(f"{path} differs from its manifest (sha256); restore it with `dvc checkout` or rerun `dvc repro {produced_by}`")


def _layout(path: Path) -> tuple[list[str], int]:
    """The case ids (metadata ``ids``) and the output elements per case, summed over the named outputs."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        ids = json.loads((handle.metadata() or {}).get("ids", "[]"))
        per_case = sum(int(np.prod(handle.get_slice(name).get_shape()[1:])) for name in handle.keys())
    return ids, per_case


def _read(path: Path, rows: np.ndarray | None) -> dict[str, np.ndarray]:
    """Named outputs, all rows or only ``rows`` (read by runs of consecutive rows, never the whole file)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        if rows is None:
            return {name: handle.get_tensor(name) for name in handle.keys()}
        runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
        out = {}
        for name in handle.keys():
            view = handle.get_slice(name)
            out[name] = np.concatenate([view[int(r[0]) : int(r[-1]) + 1] for r in runs])
        return out


def _prune(folder: Path, keep: set[Path], owned) -> None:
    """Remove what an earlier run of this stage left for dtypes no longer configured: only files the stage
    writes (``owned(relative_path)``), never anything else found there, and never through a symlink.

    Raises:
        UserError: the folder is a symlink, lies under one, or resolves outside the repository.
    """
    check_inside_repository(folder)
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_symlink():
            continue
        if path.is_file() and path not in keep and owned(path.relative_to(folder)):
            path.unlink()
        elif path.is_dir() and path.parent == folder and path.name in _OWNED_DIRS and not any(path.iterdir()):
            path.rmdir()


_FIGURES = ("loss", "scale", "envelope", "errors")
_OWNED_DIRS = {*DTYPES, "loss", "scale"}
"""The folders the stage makes: one per dtype under plots/, one per curve family (``plots.curve_rows``) under curves/."""


def _own_plot(rel: Path) -> bool:
    """``DTYPE/FIGURE.png``: a figure of this stage."""
    return len(rel.parts) == 2 and rel.parts[0] in DTYPES and rel.suffix == ".png" and rel.stem in _FIGURES


def _own_curve(rel: Path) -> bool:
    """``FAMILY/DTYPE.json``: a curve of this stage."""
    return len(rel.parts) == 2 and rel.parts[0] in _OWNED_DIRS and rel.suffix == ".json" and rel.stem in DTYPES
