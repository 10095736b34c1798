"""Everything one dtype's stages produced, loaded at once for the readers of all of it: publish, the page.

Torch-free: each file is read, and verified, through its owner. The result is the mapping that
``pipeline.present`` renders (``page``, ``verdict``, ``runs``), each artifact as the dict its file holds.
"""

from __future__ import annotations

from typing import Any

from pipeline import paths
from pipeline.artifacts import benchmark, comparison, decision, diagnosis, trial
from pipeline.files import flatten


def load(dtype: str) -> dict[str, Any]:
    """One dtype's outputs: ``dtype``, ``env``, ``manifest`` and ``trajectory`` (trial), ``stats``, ``metrics``
    (stats flattened) and ``cases`` (the per-case table, or None) of compare, ``diagnosis``, ``decision``,
    ``benchmark`` (``{"benchmarked": False, "reason": ...}`` when absent) and ``plots`` (the report's figures, name -> PNG).

    Raises:
        UserError: a stage has not run (naming it and the command).
    """
    manifest = trial.read_manifest(dtype)
    stats = comparison.read(dtype).as_dict()
    cases = paths.compare(dtype) / comparison.TABLE
    figures = paths.report_plot(dtype, "loss").parent  # every figure the report stage drew for this dtype
    return {
        "dtype": dtype,
        "env": manifest.env,
        "manifest": manifest.as_dict(),
        "trajectory": trial.read_trajectory(dtype, manifest).as_dict(),
        "stats": stats,
        "metrics": flatten(stats),
        "cases": comparison.read_table(dtype) if cases.is_file() else None,
        "diagnosis": diagnosis.read(dtype).as_dict(),
        "decision": decision.read(dtype).as_dict(),
        "benchmark": benchmark.read(dtype).as_dict(),
        "plots": {p.stem: p.read_bytes() for p in sorted(figures.glob("*.png"))},
    }
