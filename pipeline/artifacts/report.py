"""The report artifact (``data/report/``): the figures per variant and the flat curves that `dvc plots` draws.

The report stage draws them (``present.plots``) and writes them through ``Files``, which remembers what
this run wrote and then prunes what an earlier run left for variants no longer configured: only files this
stage writes, never anything else found there, never through a symlink. ``sample`` chooses which cases
the output figures draw when a fixed set is too large to read whole. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import paths
from pipeline.files import check_inside_repository, write_bytes, write_json

MAX_ELEMENTS = 2_000_000
"""Most output elements the figures read per file (16 MB in float32). Above it (a language model's logits
over a large fixed set), they draw an evenly spaced subset of cases plus every flipped one, and say so in
their titles; the counts that decide are compare's, exact, in stats.json."""

FIGURES = ("loss", "scale", "envelope", "errors")
FAMILIES = ("loss", "scale")
"""The curve families (``plots.curve_rows``): one folder each under curves/, one file per variant in it."""


@dataclass(frozen=True)
class Sample:
    """The cases the output figures draw."""

    rows: np.ndarray | None
    """Row indices, sorted; None: every case."""
    flipped: np.ndarray | None
    """Per drawn case, whether its decision flipped (None for an empty fixed set)."""
    note: str
    """What the figures' titles say about a subset ("" when every case is drawn)."""


def sample(ids: list[str], per_case: int, flipped_ids: set[str]) -> Sample:
    """Every case when the outputs fit MAX_ELEMENTS, else evenly spaced cases plus every flipped one."""
    n = len(ids)
    flipped_rows = [i for i, case in enumerate(ids) if case in flipped_ids]
    rows, note = None, ""
    if n * per_case > MAX_ELEMENTS:
        spaced = np.linspace(0, n - 1, max(1, MAX_ELEMENTS // max(per_case, 1))).astype(np.int64)
        rows = np.union1d(spaced, np.asarray(flipped_rows, dtype=np.int64))
        note = f"{len(rows)} of {n} cases drawn (evenly spaced, every flipped one)"
    chosen = np.arange(n) if rows is None else rows
    return Sample(rows=rows, flipped=np.isin(chosen, flipped_rows) if ids else None, note=note)


class Files:
    """The files of one report run: written atomically, remembered, and the stale rest pruned at the end."""

    def __init__(self, names) -> None:
        self.written: set[Path] = set()
        self.names = frozenset(names)
        """The variant names whose leftovers are the stage's own: every policy params.yaml defines."""

    def plot(self, variant: str, name: str, png: bytes) -> None:
        write_bytes(paths.report_plot(variant, name), png)
        self.written.add(paths.report_plot(variant, name))

    def curve(self, family: str, variant: str, rows: list[dict]) -> None:
        write_json(paths.report_curve(family, variant), rows)
        self.written.add(paths.report_curve(family, variant))

    def prune(self) -> None:
        """Remove what an earlier run left for variants no longer run, in the stage's two outputs.

        Raises:
            UserError: a folder is a symlink, lies under one, or resolves outside the repository.
        """
        dirs = self.names | set(FAMILIES)
        _prune(paths.REPORT / "plots", self.written, self._own_plot, dirs)
        _prune(paths.REPORT_CURVES, self.written, self._own_curve, dirs)

    def _own_plot(self, rel: Path) -> bool:
        """``NAME/FIGURE.png``: a figure of this stage."""
        return len(rel.parts) == 2 and rel.parts[0] in self.names and rel.suffix == ".png" and rel.stem in FIGURES

    def _own_curve(self, rel: Path) -> bool:
        """``FAMILY/NAME.json``: a curve of this stage."""
        return len(rel.parts) == 2 and rel.parts[0] in FAMILIES and rel.suffix == ".json" and rel.stem in self.names


def _prune(folder: Path, keep: set[Path], owned, dirs: set[str]) -> None:
    """Remove the files under ``folder`` that the stage writes (``owned(relative_path)``) and did not keep."""
    check_inside_repository(folder)
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_symlink():
            continue
        if path.is_file() and path not in keep and owned(path.relative_to(folder)):
            path.unlink()
        elif path.is_dir() and path.parent == folder and path.name in dirs and not any(path.iterdir()):
            path.rmdir()
