"""The benchmark's statistics: spreads over rounds and per-round ratios. Pure and torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping

from pipeline.artifacts.benchmark import AMP, FP32, MemoryProbe, MemorySummary, Spread
from pipeline.compare.quantiles import quantile


def spread(values: list[float]) -> Spread:
    """Median, quartiles, IQR (absolute and relative to the median), extremes and count.

    Quantiles are the project's one definition (``quantile``, nearest rank): a median is always a value that
    was measured."""
    median = quantile(values, 0.5)
    q1, q3 = quantile(values, 0.25), quantile(values, 0.75)
    rel_iqr = (q3 - q1) / abs(median) if median else math.inf
    return Spread(median, q1, q3, q3 - q1, rel_iqr, min(values), max(values), len(values))


def ratio_spread(num: list[float], den: list[float]) -> Spread:
    """Spread of per-round ratios ``num[i] / den[i]`` (rounds are paired: they share conditions)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio of {len(num)} and {len(den)} values: give the same non-zero count")
    return spread([n / d for n, d in zip(num, den)])


def memory_summary(by_variant: Mapping[str, MemoryProbe]) -> MemorySummary:
    """Peak and working memory per variant over the rounds without a skipped update, and the AMP / FP32
    ratios of both over the rounds the two have in common."""
    dropped = {name: tuple(r for r, s in enumerate(p.skipped) if s) for name, p in by_variant.items()}
    peaks = {name: [p.peak[r] for r in p.kept_rounds()] for name, p in by_variant.items()}
    working = {name: [p.peak[r] - p.baseline[r] for r in p.kept_rounds()] for name, p in by_variant.items()}
    peaks = {name: v for name, v in peaks.items() if v}
    finite = {name: w for name, w in working.items() if name in peaks and all(math.isfinite(x) for x in w)}
    memory_ratio = working_ratio = None
    if {FP32, AMP} <= set(peaks):
        n = min(len(peaks[FP32]), len(peaks[AMP]))
        memory_ratio = ratio_spread(peaks[AMP][:n], peaks[FP32][:n])
        if {FP32, AMP} <= set(finite) and all(w > 0 for w in finite[FP32][:n]):
            working_ratio = ratio_spread(finite[AMP][:n], finite[FP32][:n])
    return MemorySummary(
        peak_memory_bytes={name: spread(v) for name, v in peaks.items()},
        working_memory_bytes={name: spread(w) for name, w in finite.items()},
        memory_rounds_dropped={name: d for name, d in dropped.items() if d} or None,
        memory_ratio=memory_ratio,
        working_memory_ratio=working_ratio,
    )
