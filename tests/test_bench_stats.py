"""pipeline/bench/stats.py: spreads, per-round ratios, their intervals, the speed verdict and the memory summary, on
hand-built numbers."""

from __future__ import annotations

import math

import pytest

from pipeline.artifacts.benchmark import FASTER, NEVER, NO_DIFFERENCE, SLOWER, Interval, MemoryProbe, Spread
from pipeline.artifacts.comparison import UpdatesToLoss
from pipeline.bench.stats import median_interval, memory_summary, ratio_spread, speed, speed_verdict, spread, time_to_quality


def probe(peak: list[float], baseline: list[float], skipped: list[int] | None = None) -> MemoryProbe:
    return MemoryProbe(tuple(peak), tuple(baseline), tuple(skipped or [0] * len(peak)), "m")


def test_median_quartiles_and_iqr_are_measured_values() -> None:
    s = spread([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.q1, s.q3, s.iqr, s.min, s.max, s.n) == (3.0, 2.0, 4.0, 2.0, 1.0, 5.0, 5)
    assert s.rel_iqr == pytest.approx(2 / 3)
    # Nearest rank: the median of an even count is the lower middle value, not an interpolation.
    four = spread([1.0, 2.0, 3.0, 4.0])
    assert (four.median, four.q1, four.q3) == (2.0, 1.0, 3.0)
    assert spread([7.0]) == Spread(7.0, 7.0, 7.0, 0.0, 0.0, 7.0, 7.0, 1)
    assert spread([0.0, 0.0]).rel_iqr == math.inf


def test_ratios_are_taken_per_round_then_summarised() -> None:
    # Round-paired: (2/1, 4/2, 9/3) = (2, 2, 3); a ratio of medians would give 4/2 = 2 with no spread at all.
    r = ratio_spread([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
    assert (r.median, r.q1, r.q3, r.max) == (2.0, 2.0, 3.0, 3.0)
    with pytest.raises(ValueError):
        ratio_spread([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        ratio_spread([], [])


def test_memory_summary_peak_working_and_ratios() -> None:
    m = memory_summary({
        "fp32": probe([1000.0, 1010.0, 1000.0], [600.0, 610.0, 600.0]),
        "amp": probe([800.0, 800.0, 810.0], [600.0, 600.0, 610.0]),
    })
    assert m.peak_memory_bytes["fp32"].median == 1000.0
    assert m.working_memory_bytes["fp32"].median == 400.0 and m.working_memory_bytes["amp"].median == 200.0
    assert m.memory_ratio.median == pytest.approx(0.8)
    assert m.working_memory_ratio.median == pytest.approx(0.5)
    assert m.memory_rounds_dropped is None, "no round dropped: absent from the file"


def test_rounds_with_a_skipped_update_leave_the_memory_summary() -> None:
    m = memory_summary({"fp32": probe([10.0] * 4, [5.0] * 4), "amp": probe([99.0, 99.0, 8.0, 8.0], [5.0] * 4, [1, 2, 0, 0])})
    assert m.memory_rounds_dropped == {"amp": (0, 1)}
    assert m.peak_memory_bytes["amp"].n == 2 and m.memory_ratio.n == 2 and m.memory_ratio.median == pytest.approx(0.8)


def test_no_working_memory_without_a_baseline() -> None:
    # getrusage's lifetime peak has no baseline (NaN): peaks and their ratio, no working memory.
    m = memory_summary({"fp32": probe([10.0], [math.nan]), "amp": probe([8.0], [math.nan])})
    assert m.working_memory_bytes == {} and m.working_memory_ratio is None
    assert m.memory_ratio.median == pytest.approx(0.8)
    # Every AMP round skipped: no AMP figure and no ratio, rather than a ratio of nothing.
    none = memory_summary({"fp32": probe([10.0], [5.0]), "amp": probe([8.0], [5.0], [1])})
    assert set(none.peak_memory_bytes) == {"fp32"} and none.memory_ratio is None


def test_the_median_interval_is_the_order_statistic_interval_with_exact_coverage() -> None:
    # n = 6: only [min, max] reaches 95 % (1 - 2/64 = 0.969); n = 9: the 2nd and 8th values (1 - 2 * 10/512 = 0.961).
    six = median_interval([1.3, 1.0, 1.2, 1.5, 1.1, 1.4])
    assert (six.median, six.low, six.high, six.n) == (1.2, 1.0, 1.5, 6) and six.coverage == pytest.approx(62 / 64)
    nine = median_interval([float(v) for v in (9, 1, 8, 2, 7, 3, 6, 4, 5)])
    assert (nine.low, nine.median, nine.high) == (2.0, 5.0, 8.0) and nine.coverage == pytest.approx(1 - 20 / 512)
    # n = 20: the 6th and 15th values (coverage 0.9586; the 7th and 14th would give 0.885).
    twenty = median_interval([float(v) for v in range(1, 21)])
    assert (twenty.low, twenty.high) == (6.0, 15.0) and twenty.coverage >= 0.95
    # Five rounds: no two measured values bound the median at 95 % (1 - 2/32 = 0.9375): unbounded, so never judged.
    five = median_interval([1.5, 1.6, 1.7, 1.8, 1.9])
    assert (five.low, five.high, five.coverage, five.median) == (-math.inf, math.inf, 1.0, 1.7)
    with pytest.raises(ValueError):
        median_interval([])


def interval(low: float, high: float) -> Interval:
    return Interval((low + high) / 2, low, high, 0.95, 0.96, 9)


def test_faster_only_outside_one_and_outside_fp32_against_itself() -> None:
    aa = interval(0.95, 1.04)
    assert speed_verdict(interval(1.20, 1.40), aa) == FASTER, "a clear speedup, outside the A/A spread"
    assert speed_verdict(interval(0.30, 0.35), aa) == SLOWER, "a clear slowdown, outside the A/A spread"
    assert speed_verdict(interval(0.91, 1.12), aa) == NO_DIFFERENCE, "the interval holds 1"
    assert speed_verdict(interval(1.02, 1.30), aa) == NO_DIFFERENCE, "above 1, but it overlaps FP32 against itself"
    assert speed_verdict(interval(0.80, 0.97), aa) == NO_DIFFERENCE, "below 1, but it overlaps FP32 against itself"
    # A noisy machine whose A/A is wide: even x1.25 (1.10-1.40) is within what FP32 timed twice gives.
    assert speed_verdict(interval(1.10, 1.40), interval(0.80, 1.30)) == NO_DIFFERENCE
    assert speed_verdict(interval(-math.inf, math.inf), aa) == NO_DIFFERENCE, "too few rounds: never judged"
    assert speed_verdict(interval(1.5, 1.6), interval(-math.inf, math.inf)) == NO_DIFFERENCE, "an A/A of too few rounds"


def test_speed_pairs_each_round_with_fp32_timed_again() -> None:
    fp32 = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 1.1]
    amp = [t / 2 for t in fp32]  # twice as fast in every round, whatever the round's drift
    again = [t * f for t, f in zip(fp32, (1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01))]
    s = speed({"fp32": fp32, "amp": amp, "fp32_again": again})
    assert s.verdict == FASTER and s.speedup.low == s.speedup.high == pytest.approx(2.0)
    assert s.fp32_again.low == pytest.approx(1 / 1.02) and s.fp32_again.high == pytest.approx(1 / 0.98)
    assert "order-statistic" in s.method
    same = speed({"fp32": fp32, "amp": again, "fp32_again": again})
    assert same.verdict == NO_DIFFERENCE and same.speedup == same.fp32_again


def reach(amp: int | None, fp32: int = 100, replicates: tuple[int | None, ...] = (), skipped: int = 0) -> UpdatesToLoss:
    steps = None if amp is None else amp + skipped
    return UpdatesToLoss(target=1.0, window=10, of=250, amp=amp, amp_steps=steps, fp32=fp32, fp32_replicates=replicates)


def test_a_step_twice_as_fast_that_needs_2_5_times_the_updates_is_slower_to_quality() -> None:
    """time_to_quality_ratio = (updates_amp x time_per_step_amp) / (updates_fp32 x time_per_step_fp32)."""
    twice = Interval(2.0, 1.9, 2.1, 0.95, 0.96, 9)
    slow = time_to_quality(twice, reach(250))
    assert slow.ratio == pytest.approx(1.25) and slow.verdict == SLOWER
    assert (slow.low, slow.high) == (pytest.approx(2.5 / 2.1), pytest.approx(2.5 / 1.9))
    # The other way: a step twice as fast with 80 % of the updates takes 0.4 of FP32's time.
    fast = time_to_quality(twice, reach(80))
    assert fast.ratio == pytest.approx(0.4) and fast.verdict == FASTER and fast.high == pytest.approx(0.8 / 1.9)


def test_the_interval_widens_by_fp32s_own_range_of_updates_and_counts_the_skipped_steps_time() -> None:
    twice = Interval(2.0, 1.9, 2.1, 0.95, 0.96, 9)
    # FP32 on other data orders needed 90 and 125: AMP's 100 over [90, 125], the timing over [1.9, 2.1].
    q = time_to_quality(twice, reach(100, 100, (90, 125)))
    assert q.ratio == pytest.approx(0.5) and (q.low, q.high) == (pytest.approx(0.8 / 2.1), pytest.approx(100 / 90 / 1.9))
    # 2.5x the updates, but a replicate needed 250 too: FP32's own spread holds it, no claim either way.
    assert time_to_quality(twice, reach(250, 100, (250,))).verdict == NO_DIFFERENCE
    # A replicate that never got there: FP32's count is unbounded above, the interval reaches 0.
    assert time_to_quality(twice, reach(100, 100, (None,))).low == 0.0
    # Skipped steps reach no update but cost their time: 100 real updates in 120 steps.
    assert time_to_quality(twice, reach(100, skipped=20)).ratio == pytest.approx(0.6)
    # Too few rounds for a speedup interval: the time to quality is unbounded too, never judged.
    loose = time_to_quality(Interval(2.0, -math.inf, math.inf, 0.95, 1.0, 3), reach(80))
    assert (loose.low, loose.high, loose.verdict) == (0.0, math.inf, NO_DIFFERENCE)


def test_a_trial_that_never_reaches_fp32s_final_loss_claims_nothing_to_quality() -> None:
    q = time_to_quality(Interval(3.0, 2.9, 3.1, 0.95, 0.96, 9), reach(None, 100, (95, 110)))
    assert q.verdict == NEVER and q.ratio is q.low is q.high is None
    assert q.words() == ("never reached FP32's final loss in 250 updates (FP32 100; FP32's replicates 95-110): "
                         "no time-to-quality claim")
