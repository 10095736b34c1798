"""Everything one variant's stages produced, loaded at once for the readers of all of it: publish, the page.

Torch-free: each file is read, and verified, through its owner. The result is the mapping that
``pipeline.present`` renders (``page``, ``verdict``, ``runs``), each artifact as the dict its file holds.
"""

from __future__ import annotations

from typing import Any

from pipeline import paths
from pipeline.artifacts import audit, benchmark, comparison, decision, diagnosis, trial
from pipeline.errors import UserError
from pipeline.files import flatten


def load(variant: str) -> dict[str, Any]:
    """One variant's outputs: ``variant``, ``env``, ``manifest``, ``trajectory`` and ``audit`` (trial), ``stats``,
    ``metrics`` (stats flattened) and ``cases`` (the per-case table, or None) of compare, ``diagnosis`` (with, for a
    float16 variant, the FP16 forecast and its check), ``decision``,
    ``benchmark`` (``{"benchmarked": False, "reason": ...}`` when absent) and ``plots`` (the report's figures, name -> PNG).
    A failed trial (it raised under its policy) has no trajectory, audit, statistics or table: ``trajectory`` and
    ``audit`` are None, ``stats`` and ``metrics`` empty, ``cases`` None; its decision says where it raised.

    Raises:
        UserError: a stage has not run (naming it and the command).
    """
    manifest = trial.read_manifest(variant)
    if manifest.failed:
        return _failed(variant, manifest)
    if paths.TRIAL_AUDIT not in manifest.files:
        raise UserError(f"{paths.trial(variant)} has no {paths.TRIAL_AUDIT} (an earlier version's trial); run `dvc repro --force "
                        f"{trial.produced_by(variant)}`")
    stats = comparison.read(variant).as_dict()
    cases = paths.compare(variant) / comparison.TABLE
    figures = paths.report_plot(variant, "loss").parent  # every figure the report stage drew for this variant
    return {
        "variant": variant,
        "env": manifest.env,
        "manifest": manifest.as_dict(),
        "trajectory": trial.read_trajectory(variant, manifest),
        "audit": audit.read(paths.trial(variant), trial.produced_by(variant), manifest.files[paths.TRIAL_AUDIT]).as_dict(),
        "stats": stats,
        "metrics": flatten(stats),
        "cases": comparison.read_table(variant) if cases.is_file() else None,
        "diagnosis": diagnosis.read(variant).as_dict(),
        "decision": decision.read(variant).as_dict(),
        "benchmark": benchmark.read(variant).as_dict(),
        "plots": {p.stem: p.read_bytes() for p in sorted(figures.glob("*.png"))},
    }


def _failed(variant: str, manifest: trial.TrialManifest) -> dict[str, Any]:
    """``load`` of a failed trial: what its stages wrote (the manifest, the diagnosis and the rollback)."""
    return {
        "variant": variant, "env": manifest.env, "manifest": manifest.as_dict(), "trajectory": None, "audit": None,
        "stats": {}, "metrics": {}, "cases": None, "diagnosis": diagnosis.read(variant).as_dict(),
        "decision": decision.read(variant).as_dict(), "benchmark": benchmark.read(variant).as_dict(), "plots": {},
    }
