"""The rollback package: what it takes to go back to the FP32 reference exactly, and why.

It holds the reference policy as a params snippet, the sha256 of the reference checkpoint (weights,
optimizer state, RNG) and of its inputs, and the cases that motivated the rollback. decide writes it
(torch-free); ``python -m pipeline restore`` checks every hash (``verified_files``) before loading anything.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline import paths
from pipeline.files import read_json, sha256_file, write_bytes, write_json
from pipeline.config import Params
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import Stats


def write_package(folder: Path, params: Params, ref_manifest: dict, stats: Stats, dtype: str, cases: dict | None = None) -> None:
    snippet = {
        "seed": params.seed,
        "task": asdict(params.task),
        "reference": asdict(params.reference),
        "precision": "float32  # rolled back from autocast " + dtype,
    }
    write_bytes(folder / "reference_policy.yaml", ("# FP32 reference configuration to restore\n" + yaml.safe_dump(snippet, sort_keys=True)).encode())
    keep = (paths.REF_CHECKPOINT, paths.REF_INIT, paths.PREPARED_CASES, paths.PREPARED_TRAIN, paths.REF_CASES)
    write_json(folder / "manifest.json", {
        "dtype": dtype,
        "rule_sha256": ref_manifest["rule_sha256"],
        "reference_run_key": ref_manifest["run_key"],
        "files": {str(p): ref_manifest["files"][str(p)] for p in keep},
    })
    flips = stats.flips["flip_list"]
    per_kind = {name: {k: g for k, g in gap["per_kind"].items() if g["failing"] or g["nonfinite_trial_only"]} for name, gap in stats.values.items()}
    write_json(folder / "cases.json", {
        "motivating": cases or {},  # per failed criterion, the ids of its cases (and the training steps)
        "flips": [f for f in flips if not f["boundary"]],
        "boundary_flips": [f for f in flips if f["boundary"]],
        "value_failures_by_kind": per_kind,
    })


def verified_files(dtype: str) -> dict[str, str]:
    """The package's files (path -> sha256), each checked on disk against the package first.

    Raises:
        UserError: no package, or a file missing or whose hash differs from the package.
    """
    manifest = read_json(paths.decision(dtype) / "rollback" / "manifest.json", f"decide@{dtype}")
    for name, expected in manifest["files"].items():
        if not Path(name).is_file():
            raise UserError(f"{name} is missing; run `dvc checkout` to restore it from the DVC cache")
        if sha256_file(name) != expected:
            raise UserError(f"{name} differs from the rollback package (sha256); run `dvc checkout` to restore the frozen reference")
    return manifest["files"]
