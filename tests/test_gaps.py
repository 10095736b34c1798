"""Value gaps on hand-built tensors: tolerance bands, NaN/inf, empty outputs, different scales, chunking, FP64."""

import math

import pytest
import torch

from pipeline.compare.gaps import ArbiterStats, GapStats, value_gaps


def test_value_gaps_counts_elements_outside_atol_plus_rtol():
    ref = torch.tensor([1.0, 10.0, 100.0, 0.0])
    trial = torch.tensor([1.05, 10.3, 101.0, 0.2])
    g = value_gaps(ref, trial, atol=0.1, rtol=0.01)
    # bounds: 0.11, 0.2, 1.1, 0.1 -> fails at 10.3 (0.3 > 0.2) and 0.2 (0.2 > 0.1)
    assert g.failing == 2
    assert g.failing_fraction == 0.5
    assert g.max_abs == pytest.approx(1.0)
    # |0.0 - 0.2| with rtol*0: float32's 0.2 is 0.2000000030, so the tolerance that passes is 0.2001, not 0.2
    assert 0.2 < g.min_passing_atol <= 0.2001
    assert value_gaps(ref, trial, atol=g.min_passing_atol, rtol=0.01).failing == 0
    assert value_gaps(ref, trial, atol=0.2, rtol=0.01).failing > 0  # what rounding to nearest would have said
    assert g.min_passing_rtol == math.inf  # a zero reference can only pass through atol


def test_value_gaps_smallest_passing_tolerance_is_tight():
    ref = torch.tensor([2.0, -4.0])
    trial = torch.tensor([2.1, -4.5])
    g = value_gaps(ref, trial, atol=0.0, rtol=0.0)
    assert g.min_passing_atol == pytest.approx(0.5)
    assert g.min_passing_rtol == pytest.approx(0.125)
    assert value_gaps(ref, trial, atol=g.min_passing_atol, rtol=0.0).failing == 0
    assert value_gaps(ref, trial, atol=0.0, rtol=g.min_passing_rtol).failing == 0
    assert value_gaps(ref, trial, atol=0.49, rtol=0.0).failing == 1


def test_value_gaps_nan_and_inf_in_trial_only_fail():
    ref = torch.tensor([1.0, 2.0, 3.0])
    trial = torch.tensor([1.0, math.nan, math.inf])
    g = value_gaps(ref, trial, atol=1.0, rtol=1.0)
    assert g.nonfinite_trial_only == 2
    assert g.failing == 2
    assert g.min_passing_atol == math.inf


def test_value_gaps_nan_in_both_is_agreement_but_reported():
    ref = torch.tensor([math.nan, 1.0])
    trial = torch.tensor([math.nan, 1.0])
    g = value_gaps(ref, trial, atol=0.0, rtol=0.0)
    assert g.nonfinite_both == 1 and g.nonfinite_reference == 1
    assert g.failing == 0


def test_value_gaps_empty_outputs():
    g = value_gaps(torch.zeros(0, 3), torch.zeros(0, 3), atol=0.1, rtol=0.1)
    assert g.elements == 0 and g.failing == 0 and g.failing_fraction == 0.0
    assert g.max_abs == 0.0 and g.p99_abs == 0.0


def test_value_gaps_different_scales_need_relative_tolerance():
    # Logits near 1 and a regression output near 1e4: one atol cannot serve both, rtol can.
    ref = torch.tensor([1.0, 1.0e4])
    trial = torch.tensor([1.001, 1.0e4 + 5.0])
    assert value_gaps(ref, trial, atol=0.01, rtol=0.0).failing == 1
    assert value_gaps(ref, trial, atol=0.01, rtol=1e-3).failing == 0


def test_value_gaps_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        value_gaps(torch.zeros(2), torch.zeros(3), 0.1, 0.1)


def test_streamed_gaps_equal_one_shot_gaps_whatever_the_chunking():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1000, 7, generator=g)
    trial = ref + torch.randn(1000, 7, generator=g) * 1e-2
    ref[3, 2] = 0.0
    trial[5, 1] = math.nan
    whole = value_gaps(ref, trial, 0.01, 0.01)
    acc = GapStats(0.01, 0.01, ref.numel())
    for s in range(0, 1000, 37):
        acc.update(ref[s : s + 37], trial[s : s + 37], "ordinary" if s < 500 else "edge")
    streamed = acc.result()
    exact = ("elements", "failing", "nonfinite_trial_only", "max_abs", "p99_abs", "max_rel", "p99_rel", "min_passing_atol",
             "min_passing_rtol")
    for key in exact:
        assert getattr(streamed, key) == getattr(whole, key), key
    assert streamed.mean_abs == pytest.approx(whole.mean_abs, rel=1e-6)  # float32 sums per slice
    assert sum(k.elements for k in streamed.per_kind.values()) == 7000
    finite = ~torch.isnan(trial)
    gaps = (trial[finite].double() - ref[finite].double()).abs()
    assert streamed.p99_abs == pytest.approx(float(gaps.sort().values[math.ceil(0.99 * gaps.numel()) - 1]), rel=1e-6)


def test_failing_count_at_the_threshold_is_the_exact_test():
    """Elements within float32 rounding of atol + rtol |r|: counted as the float64 test counts them."""
    g = torch.Generator().manual_seed(12)
    r = torch.randn(300_000, generator=g) * 10
    atol, rtol = 0.05, 0.02
    bound = atol + rtol * r.double().abs()
    wiggle = torch.randn(r.shape, generator=g, dtype=torch.float64) * 1e-7
    sign = torch.sign(torch.randn(r.shape, generator=g, dtype=torch.float64))
    t = (r.double() + bound * (1 + wiggle) * sign).float()
    expected = int(((t.double() - r.double()).abs() > atol + rtol * r.double().abs()).sum())
    assert 0 < expected < r.numel()
    acc = GapStats(atol, rtol, r.numel())
    for a, b in zip(r.split(1 << 14), t.split(1 << 14)):
        acc.update(a, b)
    assert acc.result().failing == expected


def test_failing_rows_name_the_rows_update_counts():
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    trial = torch.tensor([[1.0, 2.5], [3.0, 4.0], [math.nan, 6.0]])
    acc = GapStats(0.1, 0.0, ref.numel())
    acc.update(ref, trial)
    assert acc.failing_so_far() == 2 and acc.nonfinite_so_far() == 1
    assert acc.failing_rows(ref, trial).tolist() == [True, False, True]


def test_arbiter_compares_amp_with_fp32_against_fp64():
    fp64 = torch.tensor([1.0, 2.0], dtype=torch.float64)
    acc = ArbiterStats()
    acc.update(torch.tensor([1.0, 2.0]), torch.tensor([1.1, 2.0]), fp64)
    a = acc.result()
    assert a.fp32_rmse_vs_fp64 == 0.0 and a.amp_over_fp32 == math.inf
    acc.update(torch.tensor([1.5]), torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))  # a second chunk
    b = acc.result()
    assert b.fp32_rmse_vs_fp64 == pytest.approx(math.sqrt(0.25 / 3))
    assert b.amp_rmse_vs_fp64 == pytest.approx(math.sqrt(float(torch.tensor(1.1) - 1) ** 2 / 3))
    assert b.amp_over_fp32 == pytest.approx(b.amp_rmse_vs_fp64 / b.fp32_rmse_vs_fp64)


def test_class_scores_at_softmax_probability_zero_on_both_sides_agree():
    """A masked class (``finfo(dtype).min``: -3.4e38 under FP32, -65504 under float16) is at probability exactly 0 on
    both sides: agreement, counted apart and left out of the statistics, for class scores decided through softmax
    only. A pair where one side alone is at probability 0 is judged as any."""
    low = torch.finfo(torch.float32).min
    ref = torch.tensor([[2.0, 1.0, low, low], [0.5, -1.0, 3.0, low]])
    trial = torch.tensor([[2.01, 1.0, -65504.0, -65504.0], [0.5, -1.01, 3.0, -65504.0]])
    acc = GapStats(0.05, 0.02, ref.numel(), softmax=True)
    gap = acc.update(ref, trial)
    g = acc.result()
    assert g.failing == 0 and g.zero_probability_both == 3 and g.elements == 8
    assert g.max_abs == pytest.approx(0.01, rel=1e-3) and g.min_passing_atol < 0.05 and g.min_passing_rtol < 0.02
    assert g.p99_abs < 0.05 and g.mean_abs < 0.01
    assert gap.tolist() == pytest.approx([0.01, 0.01], rel=1e-3)  # each row's largest: the pairs set aside show none
    assert not acc.failing_rows(ref, trial).any()
    assert g.as_dict()["zero_probability_both"] == 3 and type(g).from_dict(g.as_dict()) == g
    # Values, or single-value heads, are no class scores: the same pairs fail there.
    plain = value_gaps(ref, trial, 0.05, 0.02)
    assert plain.failing == 3 and plain.zero_probability_both is None and "zero_probability_both" not in plain.as_dict()
    column = GapStats(0.05, 0.02, 4, softmax=True)
    column.update(ref[0][:, None], trial[0][:, None])
    assert column.result().failing == 2 and column.result().zero_probability_both == 0
    # One side alone at probability 0 (the trial unmasks a class, or masks a legal one): a real change, judged.
    for r, t in (([0.0, low], [0.0, -3.0]), ([0.0, -3.0], [0.0, -65504.0]), ([0.0, -103.5], [0.0, -300.0])):
        one = GapStats(0.05, 0.02, 2, softmax=True)
        one.update(torch.tensor([r]), torch.tensor([t]))
        assert one.failing_so_far() == 1 and one.result().zero_probability_both == 0, (r, t)
        assert one.failing_rows(torch.tensor([r]), torch.tensor([t])).tolist() == [True]
    # The constant: 104 nats below the row's maximum is probability 0 in float32, 103.5 is not.
    assert torch.softmax(torch.tensor([0.0, -104.0]), -1)[1] == 0 and torch.softmax(torch.tensor([0.0, -103.5]), -1)[1] > 0
    far = GapStats(0.05, 0.02, 2, softmax=True)
    far.update(torch.tensor([[0.0, -104.5]]), torch.tensor([[0.0, -300.0]]))
    assert far.failing_so_far() == 0 and far.result().zero_probability_both == 1


def test_probability_zero_pairs_are_set_aside_in_passing_slices_with_large_gaps_and_per_token():
    """bfloat16's minimum (-3.39e38) against float32's passes rtol 0.02, but its gap (1.3e36) would be the reported
    max: set aside there too. Per-token scores [N, T, C] are judged per position, with non-finite pairs as before."""
    low = torch.finfo(torch.float32).min
    ref = torch.tensor([[[1.0, 0.0, low], [0.0, 2.0, low]]])
    trial = torch.tensor([[[1.0, 0.0, torch.finfo(torch.bfloat16).min], [0.0, 2.0, low]]])
    acc = GapStats(0.05, 0.02, ref.numel(), softmax=True)
    acc.update(ref, trial)
    g = acc.result()
    assert g.failing == 0 and g.zero_probability_both == 2 and g.max_abs == 0.0
    trial[0, 0, 0] = math.nan  # a non-finite trial element fails; its row's other pairs are still judged
    trial[0, 1, 2] = -65504.0
    acc = GapStats(0.05, 0.02, ref.numel(), softmax=True)
    acc.update(ref, trial)
    g = acc.result()
    assert g.failing == 1 and g.nonfinite_trial_only == 1 and g.zero_probability_both == 1  # that row's max is NaN
    assert acc.failing_rows(ref, trial).tolist() == [True]


def test_the_last_gaps_maximum_is_known_only_where_every_pair_counted():
    """``last_max``: the returned gap's largest element when both sides were finite and no pair was set aside; None
    otherwise (the caller takes the maximum itself)."""
    acc = GapStats(0.05, 0.02, 100, softmax=True)
    r = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    gap = acc.update(r, r + 0.01 * torch.arange(6.0))
    assert acc.last_max == float(gap.amax())
    acc.update(r, torch.where(torch.eye(4, 6, dtype=torch.bool), math.nan, r))
    assert acc.last_max is None
    masked = torch.full((2, 3), -1000.0)
    masked[:, 0] = 0.0
    before = acc.zero_probability_both
    acc.update(masked, masked * 0.5)  # pairs at probability 0 on both sides, set aside
    assert acc.zero_probability_both == before + 4 and acc.last_max is None
