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
from pipeline.config import Params
from pipeline.files import read_json, verify, write_bytes, write_json

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import Stats
    from pipeline.artifacts.reference import Manifest


def folder(variant: str) -> Path:
    return paths.decision(variant) / "rollback"


def write_package(params: Params, reference: Manifest, stats: Stats, variant: str, cases: dict | None = None) -> None:
    out = folder(variant)
    snippet = {
        "seed": params.seed,
        "task": asdict(params.task),
        "reference": asdict(params.reference),
        "precision": "float32  # rolled back from variant " + variant,
    }
    write_bytes(
        out / "reference_policy.yaml",
        ("# FP32 reference configuration to restore\n" + yaml.safe_dump(snippet, sort_keys=True)).encode(),
    )
    keep = (paths.REF_CHECKPOINT, paths.REF_INIT, paths.PREPARED_CASES, paths.PREPARED_TRAIN, paths.REF_CASES)
    write_json(out / "manifest.json", {
        "variant": variant,
        "rule_sha256": reference.rule_sha256,
        "reference_run_key": reference.run_key,
        "files": {str(p): reference.sha256(p) for p in keep},
    })
    flips = stats.flips.flip_list
    per_kind = {
        name: {k: g.as_dict() for k, g in gap.per_kind.items() if g.failing or g.nonfinite_trial_only}
        for name, gap in stats.values.items()
    }
    write_json(out / "cases.json", {
        "motivating": cases or {},  # per failed criterion, the ids of its cases (and the training steps)
        "flips": [f.as_dict() for f in flips if not f.boundary],
        "boundary_flips": [f.as_dict() for f in flips if f.boundary],
        "value_failures_by_kind": per_kind,
    })


def verified_files(variant: str) -> dict[str, str]:
    """The package's files (path -> sha256), each checked on disk against the package first.

    Raises:
        UserError: no package, or a file missing or whose hash differs from the package.
    """
    manifest = read_json(folder(variant) / "manifest.json", f"decide@{variant}")
    for name, expected in manifest["files"].items():
        verify(name, expected, "freeze", recorded_in="the rollback package")
    return manifest["files"]
