"""Quality of one set of outputs on the cases with a target: the metric, accumulated chunk by chunk.

Built-in metrics (``config.METRICS``) are streamed; a user metric (``module:function``) sees every target row
at once. Regression also gets its error profile (``regression_errors``: MAE, RMSE, the extremes).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from pipeline.artifacts.comparison import RegressionErrors
from pipeline.compare.decisions import labels_of
from pipeline.compare.gaps import all_finite, broken
from pipeline.errors import UserError
from pipeline.task import IGNORE_INDEX

COLUMNS = 1024
"""A regression output of at most this many columns (its last axis: [N, D], or per token [N, T, D]) is judged column by
column too: each column's atol is vetted at freeze (``vetting``), and each column's quality is reported and judged
(``QualityStats.columns``): columns of different scales pooled into one RMSE hide a destroyed small one."""


class QualityStats:
    """Quality of one set of outputs on the cases with a target, accumulated chunk by chunk.

    ``metric``: ``accuracy`` (per token: token accuracy over targets != -100), ``top_k`` (target among
    the k best scores, equal scores ranked by class index), ``neg_rmse``, ``neg_mae`` (regression, over every output
    value), ``label_accuracy`` (a regression decided at a threshold: each value on its target's side). Per-token
    classification also gives the perplexity exp(mean token NLL) (a language model's). A user metric
    (``module:function``) is not streamed: ``QualityStats`` then keeps the target rows and calls it once
    (per-token scores as tokens: ``f(scores [M, C], targets [M])``, -100 targets included).
    """

    def __init__(self, metric: str, tie_rule: str, top_k: int = 5, user: Callable | None = None,
                 decided_at: tuple[float, float] | None = None) -> None:
        self.metric, self.tie_rule, self.top_k, self.user = metric, tie_rule, top_k, user
        self.decided_at = decided_at
        """``label_accuracy``: where each value is decided, and where its target is (``streams.Metric.decided_at``)."""
        self.n = 0
        self.total = 0.0
        self.nll = 0.0
        self.per_token = False
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._columns: torch.Tensor | None = None
        """Per column of a regression output of a few columns (``COLUMNS``): the metric's sum (squared or absolute errors)."""
        self._column_rows = 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, finite: bool = False) -> torch.Tensor | None:
        """``outputs`` and ``targets`` of the cases WITH a target only; ``labels``: their decisions, ``lse``: the
        log-sum-exp of each position's scores (per token), when known; ``finite``: the caller knows every score is
        finite (the test per row is skipped). Returns the hit mask (accuracy, top_k: what the paired counts of two
        sides are taken from), else None."""
        if outputs.shape[0] == 0:
            return None
        if self.user is not None:  # per token, as tokens [M, C] and [M] (slices of a sequence may differ in length)
            o, y = outputs.detach(), targets.detach()
            if o.ndim == 3:
                o, y = o.reshape(-1, o.shape[-1]), y.reshape(-1)
            self._kept.append((o.to("cpu", copy=True), y.to("cpu", copy=True)))
            return None
        if self.metric in ("accuracy", "top_k"):
            s = outputs.detach()
            self.per_token = s.ndim == 3
            y = targets.long()
            valid = y != IGNORE_INDEX
            if bool(((y < 0) & valid).any() or (y >= s.shape[-1]).any()):
                bad = y[valid & ((y < 0) | (y >= s.shape[-1]))]
                raise UserError(
                    f"task.data: an eval target is {int(bad[0])} but the model scores {s.shape[-1]} classes; give targets in "
                    f"0..{s.shape[-1] - 1} (or -100 to ignore a position), then `dvc repro`"
                )
            if self.metric == "accuracy":
                if labels is None:
                    labels = labels_of(s, self.tie_rule)
                hit = labels == y
            else:  # the target's rank: the classes scored above it, and those equal to it of a lower index (equal
                sf = s if s.dtype in (torch.float32, torch.float64) else s.float()  # scores in one order, as
                target = sf.gather(-1, y.clamp(min=0).unsqueeze(-1))  # lowest_index: topk's order among them is its own)
                lower = torch.arange(sf.shape[-1], device=sf.device) < y.unsqueeze(-1)
                ahead = (sf > target).sum(-1) + ((sf == target) & lower).sum(-1)
                hit = ahead < min(self.top_k, sf.shape[-1])
            if not (finite or all_finite(s)):  # a row with a non-finite score is a miss, whatever the metric (-inf beside
                hit = hit & ~broken(s, softmax=True).any(-1)  # a finite maximum is a masked class: ``gaps.broken``)
            hit = hit & valid
            self.total += float(hit.sum())
            self.n += int(valid.sum())
            if self.per_token:
                sf = s if s.dtype in (torch.float32, torch.float64) else s.float()
                index = y.clamp(min=0).unsqueeze(-1)
                if lse is not None:  # known (``kl_and_lse``): only the target's score is read
                    nll = lse.double() - sf.gather(-1, index).squeeze(-1).double()
                else:  # max-shifted, accurate in float32; log_softmax is one fused pass (logsumexp takes two)
                    nll = -torch.log_softmax(sf, dim=-1).gather(-1, index).squeeze(-1).double()
                self.nll += float(torch.where(valid, nll, torch.zeros_like(nll)).sum(dtype=torch.float64))
            return hit
        else:
            p = outputs.detach().double().reshape(-1)
            y = targets.detach().double().reshape(-1)
            if p.numel() != y.numel():
                p = outputs.detach().double().reshape(outputs.shape[0], -1)[:, 0]
                y = targets.detach().double().reshape(targets.shape[0], -1)[:, 0]
            if self.metric == "label_accuracy":  # each value on its label's side of the threshold (a NaN on neither)
                value_at, label_at = self.decided_at
                valid = y != IGNORE_INDEX
                hit = ((p >= value_at) == (y >= label_at)) & ~torch.isnan(p) & valid
                self.total += float(hit.sum())
                self.n += int(valid.sum())
                return hit
            err = p - y
            part = err.pow(2) if self.metric == "neg_rmse" else err.abs()
            self.total += float(part.sum())
            self.n += err.numel()
            width = outputs.shape[-1] if outputs.ndim >= 2 else 1
            if p.numel() == outputs.numel() and 2 <= width <= COLUMNS:
                sums = part.reshape(-1, width).sum(0)
                self._columns = sums if self._columns is None else self._columns + sums
                self._column_rows += part.numel() // width
        return None

    def scored(self) -> bool:
        """Whether any case (or token) with a target was scored: a NaN ``result`` then comes from the metric itself."""
        return bool(self._kept) if self.user is not None else self.n > 0

    def result(self) -> float:
        if self.user is not None:
            if not self._kept:
                return math.nan
            value = self.user(torch.cat([o for o, _ in self._kept]), torch.cat([t for _, t in self._kept]))
            number = (isinstance(value, (int, float, np.number))  # a numpy scalar too (np.float32, np.int64)
                      or (torch.is_tensor(value) and value.numel() == 1)
                      or (isinstance(value, np.ndarray) and value.size == 1 and value.dtype != np.bool_))
            if isinstance(value, (bool, np.bool_)) or not number:
                raise UserError(f"task.metric returned {type(value).__name__} {getattr(value, 'shape', '')}; return one number")
            return float(value)
        if self.n == 0:
            return math.nan
        if self.metric in ("accuracy", "top_k", "label_accuracy"):
            return self.total / self.n
        if self.metric == "neg_rmse":
            return -math.sqrt(self.total / self.n)
        return -self.total / self.n

    def columns(self) -> tuple[float, ...] | None:
        """The metric of each column of a regression output of a few columns (``COLUMNS``); None for one column, a
        classifier or a user metric."""
        if self._columns is None or self._column_rows == 0:
            return None
        mean = self._columns / self._column_rows
        return tuple(-math.sqrt(float(v)) if self.metric == "neg_rmse" else -float(v) for v in mean)

    def counts(self) -> tuple[int, int] | None:
        """(hits, targets) of ``accuracy`` / ``top_k`` (the quality criteria compare counts, not rounded fractions);
        None for other metrics."""
        if self.user is not None or self.metric not in ("accuracy", "top_k", "label_accuracy"):
            return None
        return int(self.total), self.n

    def perplexity(self) -> float | None:
        """exp(mean NLL per target token), for per-token classification scored by accuracy or top_k."""
        if not self.per_token or self.n == 0:
            return None
        return math.exp(self.nll / self.n) if self.nll / self.n < 700 else math.inf


def regression_errors(pred: torch.Tensor, targets: torch.Tensor, extreme_quantile: float = 0.1) -> RegressionErrors:
    """MAE, RMSE, max error, and the error on the most extreme targets (top and bottom quantile)."""
    if targets.shape[0] == 0:  # no case carries a target (a rule without quality criteria judges such a set)
        return RegressionErrors(mae=math.nan, rmse=math.nan, max_error=math.nan, extreme_low_mae=math.nan,
                                extreme_high_mae=math.nan)
    p = pred.detach().double().reshape(pred.shape[0], -1)[:, 0]
    y = targets.detach().double().reshape(targets.shape[0], -1)[:, 0]
    err = (p - y).abs()
    k = max(1, int(math.ceil(extreme_quantile * y.numel())))
    order = y.argsort(stable=True)
    return RegressionErrors(
        mae=float(err.mean()),
        rmse=float(err.pow(2).mean().sqrt()),
        max_error=float(err.max()),
        extreme_low_mae=float(err[order[:k]].mean()),
        extreme_high_mae=float(err[order[-k:]].mean()),
        output_min=float(p.min()),
        output_max=float(p.max()),
    )
