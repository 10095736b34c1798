"""Nearest-rank quantiles: exact in memory, exact or within SKETCH_ALPHA in a stream, whatever the chunking."""

import math

import pytest
import torch

from pipeline.compare.quantiles import HIST_FLOOR, SKETCH_ALPHA, StreamQuantile, quantile


def test_quantile_nearest_rank():
    v = torch.arange(1, 101, dtype=torch.float64)
    assert quantile(v, 0.99) == 99.0
    assert quantile(v, 1.0) == 100.0
    assert quantile(torch.zeros(0), 0.5) == 0.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_stream_quantile_exact_and_sketch_bound():
    g = torch.Generator().manual_seed(2)
    v = torch.rand(200_000, generator=g).pow(3) * 10
    exact = quantile(v, 0.99)
    assert exact == float(v.sort().values[math.ceil(0.99 * v.numel()) - 1])
    q = StreamQuantile(0.99, v.numel())
    for part in v.split(7_919):
        q.update(part)
    assert q.exact and q.result() == exact
    sketch = StreamQuantile(0.99, v.numel(), max_exact=10)  # forced past the exact budget
    for part in v.split(7_919):
        sketch.update(part)
    assert not sketch.exact
    assert abs(sketch.result() - exact) <= SKETCH_ALPHA * exact * 1.0001


def test_histogram_quantile_bound_zeros_negatives_and_chunking():
    """Past MAX_EXACT the p99 comes from a float32 bit-pattern histogram: within SKETCH_ALPHA of the exact
    nearest rank, never above the exact max, the same for any chunking; zeros, tiny and negative values."""
    g = torch.Generator().manual_seed(11)
    v = torch.cat([torch.rand(50_000, generator=g).pow(4) * 1e3, torch.zeros(3_000), torch.full((500,), 1e-45),
                   -torch.rand(100, generator=g)])
    v = v[torch.randperm(v.numel(), generator=g)]
    for q in (0.5, 0.9, 0.99, 0.999, 1.0):
        exact = quantile(v, q)
        answers = set()
        for size in (997, 8192, v.numel()):
            sketch = StreamQuantile(q, v.numel(), max_exact=0)
            for part in v.split(size):
                sketch.update(part.double())  # float64 in: rounded to float32, far below the bound
            assert not sketch.exact
            answers.add(sketch.result())
        assert len(answers) == 1
        got = answers.pop()
        assert got <= float(v.max()) and abs(got - exact) <= SKETCH_ALPHA * abs(exact) + HIST_FLOOR
    only_negative = StreamQuantile(0.99, 100, max_exact=0)
    only_negative.update(-torch.arange(1.0, 101.0))
    assert only_negative.result() == quantile(-torch.arange(1.0, 101.0), 0.99) == -2.0  # kept exactly
    top = StreamQuantile(1.0, 1000, max_exact=0)
    top.update(torch.full((1000,), 0.3))
    assert top.result() <= float(torch.tensor(0.3)) and top.result() == pytest.approx(0.3, rel=SKETCH_ALPHA)


def test_histogram_cut_gives_the_answer_of_the_whole_stream_at_once():
    """Past ``keep`` values the histogram drops those below its cut: fed in small parts (the cut rises as they
    come, small values first or last) it answers what one update of everything answers (no value dropped)."""
    g = torch.Generator().manual_seed(5)
    small, large = torch.rand(300_000, generator=g) * 1e-3, torch.rand(300_000, generator=g).pow(4) * 50
    shuffled = torch.cat([small, large])[torch.randperm(600_000, generator=g)]
    for v in (torch.cat([small, large]), torch.cat([large, small]), shuffled):
        whole = StreamQuantile(0.99, v.numel(), max_exact=10)
        whole.update(v.clone())
        parts = StreamQuantile(0.99, v.numel(), max_exact=10)
        for part in v.split(10_007):
            parts.update(part, finite=True, vmax=float(part.max()), nonneg=True)
        assert parts._cut > 0  # the cut did rise
        assert (parts.result(), parts.upper()) == (whole.result(), whole.upper())
        assert abs(parts.result() - quantile(v, 0.99)) <= SKETCH_ALPHA * quantile(v, 0.99)


@pytest.mark.parametrize("order", ["rising", "falling", "shuffled"])
def test_past_the_cut_keying_every_value_and_selecting_first_count_the_same(order, monkeypatch):
    """Past the cut an update either keys every value (junk bucket below the cut) or selects those at or above it
    first, by the share the last update kept: either way the same histogram, so the same answer (zeros, negatives,
    values on the cut's edge and an infinity included)."""
    from pipeline.compare import quantiles

    g = torch.Generator().manual_seed(11)
    v = torch.cat([torch.rand(200_000, generator=g).pow(4) * 50, torch.zeros(5_000), -torch.rand(5_000, generator=g),
                   torch.full((3,), math.inf)])
    v = {"rising": v.sort().values, "falling": v.sort(descending=True).values,
         "shuffled": v[torch.randperm(v.numel(), generator=g)]}[order]
    hists, answers = [], []
    for share in (2.0, -1.0, quantiles.KEEP_SHARE_FILTERED):  # always select, always key, the shipped switch
        monkeypatch.setattr(quantiles, "KEEP_SHARE_FILTERED", share)
        q = StreamQuantile(0.99, v.numel() + v.numel() // 4_099 + 1, max_exact=10)  # the stream and the edge values
        for part in v.split(4_099):
            q.update(part.clone())
            if q._cut:  # the edge of the cut's bucket itself, once there is a cut: counted, not junk
                q.update(torch.tensor([q._cut_value]))
        assert q._cut > 0
        hists.append(q._hist.clone())
        answers.append((q.result(), q.upper()))
    assert torch.equal(hists[0], hists[1]) and torch.equal(hists[0], hists[2])
    assert answers[0] == answers[1] == answers[2]
