"""The rollback package: what it takes to go back to the FP32 reference exactly, and why.

It holds the reference policy as a params snippet, the sha256 of the reference checkpoint (weights,
optimizer state, RNG) and of its inputs, and the cases that motivated the rollback. decide writes it
(torch-free); ``python -m pipeline restore`` checks every hash (``verified_files``) before loading anything.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.artifacts.reference import Manifest, read_manifest
from pipeline.config import Params
from pipeline.errors import UserError
from pipeline.files import read_json, verify, write_bytes, write_json

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import Stats


FILES = (paths.REF_CHECKPOINT, paths.REF_INIT, paths.PREPARED_CASES, paths.PREPARED_TRAIN, paths.REF_CASES)
"""What a restore needs: the reference checkpoint, its initial weights, and the inputs both were made from."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def write_package(params: Params, reference: Manifest, stats: Stats | None, variant: str, cases: dict | None = None,
                  decision_folder: Path | None = None) -> None:
    """``stats`` None: a failed trial (it raised under its policy), whose motivating cases are the one that raised.
    ``decision_folder``: the decision's new folder, written beside the old (``decision.write``); default its folder."""
    out = folder(variant) if decision_folder is None else decision_folder / folder(variant).name
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
    files = {str(p): reference.sha256(p) for p in FILES}
    write_json(out / "manifest.json", Package(variant, reference.rule_sha256, reference.run_key, files).as_dict())
    flips = stats.flips.flip_list if stats is not None else ()
    per_kind = {
        name: {k: g.as_dict() for k, g in gap.per_kind.items() if g.failing or g.nonfinite_trial_only}
        for name, gap in (stats.values if stats is not None else {}).items()
    }
    write_json(out / "cases.json", {
        "motivating": cases or {},  # per failed criterion, the ids of its cases (and the training steps)
        "flips": [f.as_dict() for f in flips if not f.boundary],
        "boundary_flips": [f.as_dict() for f in flips if f.boundary],
        "value_failures_by_kind": per_kind,
    })


def verified_files(variant: str) -> dict[str, str]:
    """The package's files (path -> sha256), each checked on disk against the package first.

    The package must be ``variant``'s, name exactly the files a restore needs (``FILES``: none missing, none
    elsewhere) by sha256, and be the package of the reference on disk (its run key and rule); otherwise restore
    would load another reference's state under this variant's name, or stop in a traceback.

    Raises:
        UserError: no package, one of another version, variant or reference, or a file missing or whose hash differs
            from the package.
    """
    path = folder(variant) / "manifest.json"
    fix = f"rebuild it with `dvc repro -f decide@{variant}`"
    package = Package.parse(
        read_json(path, f"decide@{variant}"), lambda why: f"{path} is not a rollback package of this version ({why}); {fix}"
    )
    problem = _package_problem(package, variant, read_manifest())
    if problem:
        raise UserError(f"{path} {problem}; {fix}")
    for name, expected in package.files.items():
        verify(name, expected, "freeze", recorded_in="the rollback package")
    return package.files


def _package_problem(package: Package, variant: str, ref: Manifest) -> str | None:
    """What makes ``package`` not ``variant``'s package of the reference ``ref`` (None: nothing)."""
    if package.variant != variant:
        return f"is variant {package.variant!r}'s package, not {variant!r}'s"
    if set(package.files) != {str(p) for p in FILES}:  # a dict: ``Package.parse`` checked
        return f"must list exactly {', '.join(map(str, FILES))}"
    if not all(isinstance(h, str) and _SHA256.match(h) for h in package.files.values()):
        return "lists a sha256 that is not 64 hexadecimal digits"
    if (package.reference_run_key, package.rule_sha256) != (ref.run_key, ref.rule_sha256):
        return f"was made from another reference or rule than {paths.REF_MANIFEST}'s (run key, rule sha256)"
    return None
