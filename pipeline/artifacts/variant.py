"""Everything one dtype's stages produced, loaded at once for the readers of all of it: publish, the page.

Torch-free: each file is read through its owner where it has one. The result is the mapping that
``pipeline.present`` renders (``page``, ``verdict``, ``runs``).
"""

from __future__ import annotations

from typing import Any

from pipeline import paths
from pipeline.artifacts import comparison
from pipeline.files import read_json
from pipeline.present.page import flat


def load(dtype: str) -> dict[str, Any]:
    """One dtype's outputs: ``dtype``, ``env``, ``manifest`` and ``trajectory`` (trial), ``stats``, ``metrics``
    (stats flattened) and ``cases`` (the per-case table, or None) of compare, ``diagnosis``, ``decision``,
    ``benchmark`` (``{"benchmarked": False, ...}`` when absent) and ``plots`` (the report's figures, name -> PNG).

    Raises:
        UserError: a stage has not run (naming it and the command).
    """
    manifest = read_json(paths.trial(dtype) / "manifest.json", f"trial@{dtype}")
    stats = comparison.read(dtype).to_dict()
    bench_file = paths.benchmark(dtype) / "benchmark.json"
    cases = paths.compare(dtype) / comparison.TABLE
    figures = paths.report_plot(dtype, "loss").parent  # every figure the report stage drew for this dtype
    return {
        "dtype": dtype,
        "env": manifest["env"],
        "manifest": manifest,
        "trajectory": read_json(paths.trial(dtype) / "trajectory.json", f"trial@{dtype}"),
        "stats": stats,
        "metrics": flat(stats),
        "cases": comparison.read_table(dtype) if cases.is_file() else None,
        "diagnosis": read_json(paths.diagnose(dtype) / "diagnosis.json", f"diagnose@{dtype}"),
        "decision": read_json(paths.decision(dtype) / "decision.json", f"decide@{dtype}"),
        "benchmark": read_json(bench_file, f"benchmark@{dtype}") if bench_file.is_file() else {"benchmarked": False, "reason": "benchmark.json not found"},
        "plots": {p.stem: p.read_bytes() for p in sorted(figures.glob("*.png"))},
    }
