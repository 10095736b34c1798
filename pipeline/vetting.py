"""The acceptance rule vetted against the FP32 reference at freeze, before any trial.

freeze hands a ``Scan`` to ``reference.write``: it sees the outputs as they stream to disk (names, shapes,
RMS per output, the reference's quality with compare's metric) and, with the trajectory, asks
``rule.vet_rule`` whether the rule can judge trials of this reference at all. A refusal is one line and
leaves the previous reference in place. Only freeze imports this module (trial and compare do not pay for it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipeline import cases, task

from pipeline import rule

from pipeline.compare import streams
from pipeline.compare.quality import QualityStats
from pipeline.config import FEATURE_NAMES, Params, primary_name

if TYPE_CHECKING:
    from pipeline.artifacts.steps import StepRecord


COLUMNS = 1024
"""A regression output of at most this many columns is vetted column by column too (``Scan.column_squares``)."""

SLICE_ELEMENTS = 4_000_000
"""Elements squared in float64 at once (32 MB): a chunk of an LM's scores, [256, 64, 32000], would need 8 GB."""


class Scan:
    """What the rule is vetted against at freeze, gathered while the outputs stream to disk: each output's
    name, shape and RMS, and the reference's quality on the fixed set (the metric compare uses)."""

    def __init__(self, params: Params, fixed: cases.Cases) -> None:
        self.rule, self.kind = params.acceptance, params.task.kind
        self.metric = streams.Metric.for_task(params.task)
        self.quality = QualityStats(self.metric.name, params.acceptance.tie_rule, self.metric.top_k, self.metric.function)
        self.targets = streams.masked_targets(fixed.y, streams.token_mask_of(fixed.x))
        self.has_target = fixed.has_target.bool()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.squares: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.column_squares: dict[str, torch.Tensor] = {}
        """Per column, for outputs of values of a few columns (``_by_column``): columns of different scales share one
        atol, which must bound the smallest too."""

    def update(self, row: int, chunk: dict[str, torch.Tensor]) -> None:
        """The chunk's rows from ``row`` on, a slice of rows at a time (``SLICE_ELEMENTS``): an LM's chunk holds GBs
        of scores, and its float64 squares or its rows with a target copied whole would hold as many again."""
        main = primary_name(chunk)
        out = chunk[main]
        for name, v in chunk.items():
            self.shapes[name] = tuple(v.shape[1:])
            self.count[name] = self.count.get(name, 0) + v.numel()
            self.squares.setdefault(name, 0.0)
            rows = task.rows_within(SLICE_ELEMENTS, math.prod(v.shape[1:]))
            by_column = self._by_column(name, v, name == main)
            for a in range(0, v.shape[0], rows):
                b = min(a + rows, v.shape[0])
                squares = v[a:b].detach().double().square()
                self.squares[name] += float(squares.sum())
                if by_column:
                    self.column_squares[name] = self.column_squares.get(name, 0.0) + squares.reshape(-1, v.shape[-1]).sum(0)
                if v is out:
                    keep = self.has_target[row + a : row + b]
                    if bool(keep.any()):
                        self.quality.update(out[a:b][keep], self.targets[row + a : row + b][keep])

    def _by_column(self, name: str, v: torch.Tensor, primary: bool) -> bool:
        """Whether output ``name`` holds values of a few columns (``COLUMNS``, the last axis: [N, D] or per token
        [N, T, D]) that one atol bounds: a regression's outputs, and a classifier's said ``decisions: false``; not
        the decided heads, whose class scores share one scale, nor a classifier's features (an embedding's
        dimensions are no quantities of their own: ``FEATURE_NAMES``)."""
        if v.ndim < 2 or not 2 <= v.shape[-1] <= COLUMNS:
            return False
        tolerance = self.rule.tolerance(name)
        if self.kind == "regression":  # its primary holds values whatever its name (a regression head's logits)
            return primary or not tolerance.decides(name, self.kind)
        return tolerance.decisions is False and not FEATURE_NAMES.search(name)

    def rms(self) -> dict[str, float]:
        return {name: math.sqrt(self.squares[name] / self.count[name]) if self.count[name] else 0.0 for name in self.squares}

    def column_rms(self) -> dict[str, tuple[float, ...]]:
        """Per output with ``column_squares``: the RMS of each column."""
        return {name: tuple((sq * (sq.numel() / self.count[name])).sqrt().tolist()) for name, sq in self.column_squares.items()}

    def problem(self, ref_steps: Sequence[StepRecord]) -> str | None:
        """The first reason the rule cannot judge this reference (``rule.vet_rule``), or None."""
        return rule.vet_rule(self.rule, self.kind, self.shapes, self.rms(), self.quality.result(), self.metric.name,
                             self.metric.higher_is_better, ref_steps, columns=self.column_rms())
