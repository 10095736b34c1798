"""Pure numerics on hand-built tensors: gaps, ties, flips, NaN/inf, empty outputs, different scales."""

import math

import pytest
import torch

from pipeline import numerics


def test_value_gaps_counts_elements_outside_atol_plus_rtol():
    ref = torch.tensor([1.0, 10.0, 100.0, 0.0])
    trial = torch.tensor([1.05, 10.3, 101.0, 0.2])
    g = numerics.value_gaps(ref, trial, atol=0.1, rtol=0.01)
    # bounds: 0.11, 0.2, 1.1, 0.1 -> fails at 10.3 (0.3 > 0.2) and 0.2 (0.2 > 0.1)
    assert g["failing"] == 2
    assert g["failing_fraction"] == 0.5
    assert g["max_abs"] == pytest.approx(1.0)
    assert g["min_passing_atol"] == pytest.approx(0.2)  # |0.0 - 0.2| with rtol*0 = 0.2
    assert g["min_passing_rtol"] == math.inf  # a zero reference can only pass through atol


def test_value_gaps_smallest_passing_tolerance_is_tight():
    ref = torch.tensor([2.0, -4.0])
    trial = torch.tensor([2.1, -4.5])
    g = numerics.value_gaps(ref, trial, atol=0.0, rtol=0.0)
    assert g["min_passing_atol"] == pytest.approx(0.5)
    assert g["min_passing_rtol"] == pytest.approx(0.125)
    assert numerics.value_gaps(ref, trial, atol=g["min_passing_atol"], rtol=0.0)["failing"] == 0
    assert numerics.value_gaps(ref, trial, atol=0.0, rtol=g["min_passing_rtol"])["failing"] == 0
    assert numerics.value_gaps(ref, trial, atol=0.49, rtol=0.0)["failing"] == 1


def test_value_gaps_nan_and_inf_in_trial_only_fail():
    ref = torch.tensor([1.0, 2.0, 3.0])
    trial = torch.tensor([1.0, math.nan, math.inf])
    g = numerics.value_gaps(ref, trial, atol=1.0, rtol=1.0)
    assert g["nonfinite_trial_only"] == 2
    assert g["failing"] == 2
    assert g["min_passing_atol"] == math.inf


def test_value_gaps_nan_in_both_is_agreement_but_reported():
    ref = torch.tensor([math.nan, 1.0])
    trial = torch.tensor([math.nan, 1.0])
    g = numerics.value_gaps(ref, trial, atol=0.0, rtol=0.0)
    assert g["nonfinite_both"] == 1 and g["nonfinite_reference"] == 1
    assert g["failing"] == 0


def test_value_gaps_empty_outputs():
    g = numerics.value_gaps(torch.zeros(0, 3), torch.zeros(0, 3), atol=0.1, rtol=0.1)
    assert g["elements"] == 0 and g["failing"] == 0 and g["failing_fraction"] == 0.0
    assert g["max_abs"] == 0.0 and g["p99_abs"] == 0.0


def test_value_gaps_different_scales_need_relative_tolerance():
    # Logits near 1 and a regression output near 1e4: one atol cannot serve both, rtol can.
    ref = torch.tensor([1.0, 1.0e4])
    trial = torch.tensor([1.001, 1.0e4 + 5.0])
    assert numerics.value_gaps(ref, trial, atol=0.01, rtol=0.0)["failing"] == 1
    assert numerics.value_gaps(ref, trial, atol=0.01, rtol=1e-3)["failing"] == 0


def test_value_gaps_rejects_shape_mismatch():
    with pytest.raises(ValueError):
        numerics.value_gaps(torch.zeros(2), torch.zeros(3), 0.1, 0.1)


def test_quantile_nearest_rank():
    v = torch.arange(1, 101, dtype=torch.float64)
    assert numerics.quantile(v, 0.99) == 99.0
    assert numerics.quantile(v, 1.0) == 100.0
    assert numerics.quantile(torch.zeros(0), 0.5) == 0.0


def test_worked_example_from_the_guide_tiny_gap_flips_the_decision():
    """Scores 1.0000 and 1.0003: FP16 cannot tell them apart (spacing near 1 is 2**-10), the tie
    goes to the lowest index, and the decision flips although the value gap is 3e-4."""
    ref = torch.tensor([[1.0000, 1.0003]])
    trial = ref.half().float()  # allowed: rounds two scores to FP16, the guide's worked example
    assert trial[0, 0] == trial[0, 1]  # real FP16 rounding, not a hand-made tie
    gap = numerics.value_gaps(ref, trial, atol=1e-3, rtol=0.0)
    assert gap["failing"] == 0  # within a 1e-3 tolerance...
    flips = numerics.classification_flips(["ordinary/x"], ["ordinary"], ref, trial, "lowest_index", boundary_margin=0.0)
    assert flips["flips"] == 1  # ...yet the action changes
    assert flips["flip_list"][0]["reference_class"] == 1 and flips["flip_list"][0]["trial_class"] == 0
    # With a boundary margin above the reference margin (3e-4) the same flip is a boundary flip.
    flips = numerics.classification_flips(["ordinary/x"], ["ordinary"], ref, trial, "lowest_index", boundary_margin=1e-3)
    assert flips["flips"] == 0 and flips["boundary_flips"] == 1


def test_tie_rules():
    scores = torch.tensor([[2.0, 2.0, 1.0], [0.0, 3.0, 3.0], [1.0, 0.0, 0.0]])
    labels, margin = numerics.decisions(scores, "lowest_index")
    assert labels.tolist() == [0, 1, 0]
    assert margin.tolist() == [0.0, 0.0, 1.0]
    labels, _ = numerics.decisions(scores, "tie_is_flip")
    assert labels.tolist() == [-1, -1, 0]


def test_tie_is_flip_counts_a_new_tie_as_a_flip_even_when_lowest_index_would_agree():
    ref = torch.tensor([[2.0, 1.9]])
    trial = torch.tensor([[2.0, 2.0]])
    assert numerics.classification_flips(["a"], ["ordinary"], ref, trial, "lowest_index", 0.0)["flips"] == 0
    assert numerics.classification_flips(["a"], ["ordinary"], ref, trial, "tie_is_flip", 0.0)["flips"] == 1


def test_nan_scores_never_match_a_decision():
    ref = torch.tensor([[1.0, 0.0]])
    trial = torch.tensor([[math.nan, 0.0]])
    flips = numerics.classification_flips(["a"], ["edge"], ref, trial, "lowest_index", 0.0)
    assert flips["flips"] == 1 and flips["flip_list"][0]["trial_class"] == -2


def test_boundary_flips_are_counted_apart():
    ref = torch.tensor([[1.0, 0.99], [5.0, 0.0], [0.0, 0.02]])
    trial = torch.tensor([[0.98, 0.99], [0.0, 5.0], [0.0, 0.02]])
    f = numerics.classification_flips(["b", "o", "c"], ["boundary", "ordinary", "ordinary"], ref, trial, "lowest_index", 0.05)
    assert f["boundary_cases"] == 2  # margins 0.01 and 0.02
    assert f["boundary_flips"] == 1 and f["flips"] == 1
    assert f["boundary_flip_fraction"] == 0.5


def test_regression_flips_across_threshold():
    ref = torch.tensor([[0.9], [1.1], [2.0]])
    trial = torch.tensor([[1.0], [1.1], [1.9]])
    f = numerics.regression_flips(["a", "b", "c"], ["ordinary"] * 3, ref, trial, threshold=1.0)
    assert f["flips"] == 1 and f["flip_list"][0]["id"] == "a"
    assert numerics.regression_flips(["a"], ["ordinary"], ref[:1], trial[:1], None)["flips"] == 0


def test_regression_errors_and_extremes():
    y = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0])
    p = torch.tensor([0.0, 1.0, 2.0, 3.0, 8.0])
    e = numerics.regression_errors(p, y, extreme_quantile=0.2)
    assert e["mae"] == pytest.approx(0.4)
    assert e["rmse"] == pytest.approx(math.sqrt(4 / 5))
    assert e["max_error"] == 2.0
    assert e["extreme_high_mae"] == 2.0 and e["extreme_low_mae"] == 0.0
    assert e["output_max"] == 8.0


def test_accuracy_and_quality():
    scores = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert numerics.accuracy(scores, torch.tensor([1, 1]), "lowest_index") == 0.5
    assert numerics.quality("regression", torch.tensor([[1.0], [3.0]]), torch.tensor([[1.0], [1.0]]), "lowest_index") == pytest.approx(-math.sqrt(2))


def test_trajectory_gap_band_and_nonfinite():
    g = numerics.trajectory_gap([2.0, 1.0, 0.5], [2.0, 1.2, math.nan], atol=0.05, rtol=0.1)
    assert g["band_violations"] == 2 and g["first_violation_step"] == 1
    assert g["max_loss_gap"] == math.inf
    ok = numerics.trajectory_gap([2.0, 1.0], [2.1, 1.05], atol=0.05, rtol=0.1)
    assert ok["band_violations"] == 0


def test_update_health_detects_stall_and_skips():
    h = numerics.update_health([False, True, True, True], [4.0, 2.0, 1.0, 0.5, 0.25], [False] * 4, window=3)
    assert h["stalled"] and h["skipped_steps"] == 3 and h["real_updates"] == 1
    assert h["final_scale"] == 0.25
    assert not numerics.update_health([True, False], [1.0, 1.0, 1.0], [False, False], window=2)["stalled"]


def test_error_vs_arbiter():
    fp64 = torch.tensor([1.0, 2.0], dtype=torch.float64)
    a = numerics.error_vs_arbiter(torch.tensor([1.0, 2.0]), torch.tensor([1.1, 2.0]), fp64)
    assert a["fp32_rmse_vs_fp64"] == 0.0 and a["amp_over_fp32"] == math.inf
