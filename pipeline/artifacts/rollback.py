"""The rollback package: what it takes to go back to the FP32 reference exactly, and why.

It holds the reference policy as a params snippet, the sha256 of the reference checkpoint (weights,
optimizer state, RNG) and of its inputs, and the cases that motivated the rollback. decide writes it
(torch-free); ``python -m pipeline restore`` checks every hash (``verified_files``) before loading anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.config import Params
from pipeline.files import read_json, verify, write_bytes, write_json

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import Stats
    from pipeline.artifacts.reference import Manifest


def folder(variant: str) -> Path:
    return paths.decision(variant) / "rollback"


@dataclass(frozen=True)
class Package(Record):
    """The package's ``manifest.json``: the rolled-back variant, the rule and reference it was judged under, and the
    sha256 of every file a restore needs."""

    variant: str
    rule_sha256: str
    reference_run_key: str
    files: dict[str, str]
    """Path (from the repository root) -> sha256."""


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
    files = {str(p): reference.sha256(p) for p in keep}
    write_json(out / "manifest.json", Package(variant, reference.rule_sha256, reference.run_key, files).as_dict())
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
        UserError: no package, one of another version, or a file missing or whose hash differs from the package.
    """
    path = folder(variant) / "manifest.json"
    package = Package.parse(
        read_json(path, f"decide@{variant}"),
        lambda why: f"{path} is not a rollback package of this version ({why}); run `dvc repro -f decide@{variant}`",
    )
    for name, expected in package.files.items():
        verify(name, expected, "freeze", recorded_in="the rollback package")
    return package.files
