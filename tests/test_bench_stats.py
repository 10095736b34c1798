"""pipeline/bench/stats.py: spreads, per-round ratios and the memory summary, on hand-built numbers."""

from __future__ import annotations

import math

import pytest

from pipeline.artifacts.benchmark import MemoryProbe, Spread
from pipeline.bench.stats import memory_summary, ratio_spread, spread


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
