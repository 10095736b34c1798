"""The benchmark's statistics: spreads over rounds, per-round ratios, their intervals and the speed verdict. Pure.

The speed verdict compares two intervals from the same interleaved rounds: FP32 / AMP (the speedup) and FP32 /
FP32 again (the A/A: the same update timed twice, whose ratio is 1 but for the timing's noise). Each is the
distribution-free confidence interval of the median of the per-round ratios by order statistics (the sign-test
interval: [x_(k), x_(n+1-k)] of the sorted ratios, k the largest rank whose exact binomial coverage
1 - 2 P(Binomial(n, 1/2) < k) is still at least 95 %). It needs no assumption on the shape of the noise, no random
draw (the same rounds give the same interval), and at least 6 rounds: with fewer, no two measured values bound the
median at 95 % and the interval is unbounded, so nothing is called faster or slower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pipeline.artifacts.benchmark import (
    AMP, FASTER, FP32, FP32_AGAIN, NEVER, NO_DIFFERENCE, SLOWER, Interval, MemoryProbe, MemorySummary, Speed, SpeedVerdict,
    Spread, TimeToQuality,
)
from pipeline.artifacts.comparison import UpdatesToLoss
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
    return spread(ratios(num, den))


LEVEL = 0.95
"""Confidence of the speedup's and the A/A's intervals."""


def ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-round ratios ``num[i] / den[i]`` (rounds are paired: they share conditions)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio of {len(num)} and {len(den)} values: give the same non-zero count")
    return [n / d for n, d in zip(num, den)]


def median_interval(values: list[float], level: float = LEVEL) -> Interval:
    """The order-statistic (sign-test) confidence interval of the median of ``values`` at ``level`` or more.

    [x_(k), x_(n+1-k)] of the sorted values, k the largest rank with 1 - 2 P(Binomial(n, 1/2) <= k - 1) >= level
    (exact, distribution-free). Too few values for any such k (n < 6 at 95 %): [-inf, inf], coverage 1.
    """
    if not values:
        raise ValueError("no values: an interval needs at least one")
    n, ordered = len(values), sorted(values)
    below = 0.0  # P(B <= k - 1), B ~ Binomial(n, 1/2)
    k = 0
    while k < n // 2 + 1 and 1 - 2 * (below + math.comb(n, k) / 2**n) >= level:
        below += math.comb(n, k) / 2**n
        k += 1
    median = quantile(values, 0.5)
    if k == 0:
        return Interval(median, -math.inf, math.inf, level, 1.0, n)
    return Interval(median, ordered[k - 1], ordered[n - k], level, 1 - 2 * below, n)


def speed_verdict(speedup: Interval, fp32_again: Interval) -> SpeedVerdict:
    """AMP is ``faster`` only if the whole speedup interval (FP32 / AMP) lies above 1 and above the whole A/A interval
    (FP32 / FP32 again); ``slower`` if it lies below 1 and below the A/A's; else ``no measurable difference``: an
    interval that holds 1, or overlaps what FP32 timed against itself gives, is within the timing's noise."""
    if speedup.low > 1 and speedup.low > fp32_again.high:
        return FASTER
    if speedup.high < 1 and speedup.high < fp32_again.low:
        return SLOWER
    return NO_DIFFERENCE


def speed(times: dict[str, list[float]]) -> Speed:
    """The speed verdict from the kept per-round times of ``fp32``, ``amp`` and ``fp32_again``."""
    speedup = median_interval(ratios(times[FP32], times[AMP]))
    again = median_interval(ratios(times[FP32], times[FP32_AGAIN]))
    method = (
        f"median of per-round ratios, {100 * LEVEL:.0f} % order-statistic (sign-test) interval, exact binomial coverage; "
        "faster or slower only outside 1 and outside the A/A interval (FP32 against FP32 timed again in the same rounds)"
    )
    return Speed(speed_verdict(speedup, again), speedup, again, method)


TO_QUALITY_METHOD = (
    "time_to_quality_ratio = (AMP's steps to FP32's final loss x AMP's time per step) / (FP32's x FP32's) = updates ratio "
    "/ step speedup; the updates are one run's count each (the trial's, the reference's), so the interval is the "
    "speedup's 95 % interval widened by FP32's own range of updates (the reference and each replicate, each on its own "
    "data order): a bound, not a confidence level; faster or slower to quality only where it excludes 1"
)


def time_to_quality(speedup: Interval, reach: UpdatesToLoss) -> TimeToQuality:
    """AMP's time to reach FP32's final loss over FP32's, with its interval.

    time_to_quality_ratio = (updates_amp x time_per_step_amp) / (updates_fp32 x time_per_step_fp32)
                          = (updates_amp / updates_fp32) / speedup          below 1: AMP gets there sooner.

    ``updates_amp`` counts AMP's steps up to the crossing, skipped ones too (a step the GradScaler skipped costs its
    time; ``reach.amp``, the real updates, is what the words quote); ``updates_fp32`` is the reference's own count by the
    same rule (``reach.fp32``: its smoothed curve may dip to its final loss before its last step; comparing AMP's first
    crossing with FP32's last step would favour AMP). Each is one run's count: no interval of its own. FP32's
    replicates, each trained on another data order, say how far that count moves: the interval takes the speedup's
    95 % interval [s_low, s_high] and FP32's range of counts [c_min, c_max] (the reference's and the replicates'; a
    replicate that never got there makes c_max unbounded) and gives [u / c_max / s_high, u / c_min / s_low]: the
    timing's uncertainty and FP32's own spread of updates at once, a conservative bound rather than a 95 % interval.
    """
    if reach.amp is None or reach.amp_steps is None or not reach.fp32:
        return TimeToQuality(NEVER if reach.amp is None else NO_DIFFERENCE, reach.target, reach.amp, reach.of, reach.fp32,
                             reach.fp32_replicates, None, None, None, TO_QUALITY_METHOD)
    counts = [math.inf if c is None else c for c in (reach.fp32, *reach.fp32_replicates)]
    u = reach.amp_steps
    ratio = u / reach.fp32 / speedup.median
    low = u / max(counts) / speedup.high if speedup.high > 0 else math.inf
    high = u / min(counts) / speedup.low if speedup.low > 0 and min(counts) > 0 else math.inf
    verdict = FASTER if high < 1 else SLOWER if low > 1 else NO_DIFFERENCE
    return TimeToQuality(verdict, reach.target, reach.amp, reach.of, reach.fp32, reach.fp32_replicates, ratio, low, high,
                         TO_QUALITY_METHOD)


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
