"""Everything one variant's stages produced, loaded at once for the readers of all of it: publish, the page.

Torch-free: each file is read, and verified, through its owner. ``Variant`` holds the typed records that
``pipeline.present`` renders (``page``, ``verdict``, ``runs``), read by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import paths
from pipeline.artifacts import audit, benchmark, comparison, decision, diagnosis, trial
from pipeline.errors import UserError


@dataclass(frozen=True)
class Variant:
    """One variant's records. A failed trial (it raised under its policy) has no trajectory, audit, statistics or
    table (each None) and no figures; its decision says where it raised."""

    name: str
    manifest: trial.TrialManifest
    decision: decision.Decision
    diagnosis: diagnosis.Diagnosis
    """With, for a float16 variant, the FP16 forecast and its check (``forecast``)."""
    benchmark: benchmark.Measured
    """``NotBenchmarked`` (with its reason) when rolled back or not run yet."""
    stats: comparison.Stats | None = None
    audit: audit.Audit | None = None
    trajectory: trial.Trajectory | None = None
    cases: list[dict] | None = None
    """Compare's per-case table (``cases.json``), or None."""
    plots: dict[str, bytes] = field(default_factory=dict)
    """The report's figures, name -> PNG."""


def load(variant: str) -> Variant:
    """One variant's records, each read and verified by its owner.

    Raises:
        UserError: a stage has not run (naming it and the command).
    """
    manifest = trial.read_manifest(variant)
    if manifest.failed:  # what its stages wrote: the manifest, the diagnosis and the rollback
        found = diagnosis.read(variant)
        return Variant(variant, manifest, decision.read(variant), found, benchmark.read(variant))
    if paths.TRIAL_AUDIT not in manifest.files:
        raise UserError(f"{paths.trial(variant)} has no {paths.TRIAL_AUDIT} (an earlier version's trial); run `dvc repro --force "
                        f"{trial.produced_by(variant)}`")
    stats = comparison.read(variant)
    trajectory = trial.read_trajectory(variant, manifest)
    engaged = audit.read(paths.trial(variant), trial.produced_by(variant), manifest.files[paths.TRIAL_AUDIT])
    cases = paths.compare(variant) / comparison.TABLE
    table = comparison.read_table(variant) if cases.is_file() else None
    found, decided = diagnosis.read(variant), decision.read(variant)
    figures = paths.report_plot(variant, "loss").parent  # every figure the report stage drew for this variant
    return Variant(variant, manifest, decided, found, benchmark.read(variant), stats=stats, audit=engaged,
                   trajectory=trajectory, cases=table, plots={p.stem: p.read_bytes() for p in sorted(figures.glob("*.png"))})
