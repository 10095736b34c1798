"""Pure numerics on hand-built tensors: gaps, ties, flips, NaN/inf, empty outputs, different scales."""

import math

import pytest
import torch

from pipeline.compare import numerics


def test_value_gaps_counts_elements_outside_atol_plus_rtol():
    ref = torch.tensor([1.0, 10.0, 100.0, 0.0])
    trial = torch.tensor([1.05, 10.3, 101.0, 0.2])
    g = numerics.value_gaps(ref, trial, atol=0.1, rtol=0.01)
    # bounds: 0.11, 0.2, 1.1, 0.1 -> fails at 10.3 (0.3 > 0.2) and 0.2 (0.2 > 0.1)
    assert g["failing"] == 2
    assert g["failing_fraction"] == 0.5
    assert g["max_abs"] == pytest.approx(1.0)
    # |0.0 - 0.2| with rtol*0: float32's 0.2 is 0.2000000030, so the tolerance that passes is 0.2001, not 0.2
    assert 0.2 < g["min_passing_atol"] <= 0.2001
    assert numerics.value_gaps(ref, trial, atol=g["min_passing_atol"], rtol=0.01)["failing"] == 0
    assert numerics.value_gaps(ref, trial, atol=0.2, rtol=0.01)["failing"] > 0  # what rounding to nearest would have said
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
    # With a boundary margin above the reference margin (3e-4) the same flip of a REAL sample is a
    # near-boundary flip: counted apart from constructed boundary cases, never silently allowed.
    flips = numerics.classification_flips(["ordinary/x"], ["ordinary"], ref, trial, "lowest_index", boundary_margin=1e-3)
    assert flips["flips"] == 0 and flips["near_boundary_flips"] == 1 and flips["boundary_flips"] == 0
    assert flips["flip_list"][0]["near_boundary"] and not flips["flip_list"][0]["boundary"]


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
    assert f["boundary_cases"] == 1  # the constructed one
    assert f["near_boundary_cases"] == 1  # the real sample of margin 0.02
    assert f["boundary_flips"] == 1 and f["flips"] == 1 and f["near_boundary_flips"] == 0
    assert f["boundary_flip_fraction"] == 1.0


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


# ---------------------------------------------------------------- streaming, per token, margins, noise


def test_streamed_gaps_equal_one_shot_gaps_whatever_the_chunking():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1000, 7, generator=g)
    trial = ref + torch.randn(1000, 7, generator=g) * 1e-2
    ref[3, 2] = 0.0
    trial[5, 1] = math.nan
    whole = numerics.value_gaps(ref, trial, 0.01, 0.01)
    acc = numerics.GapStats(0.01, 0.01, ref.numel())
    for s in range(0, 1000, 37):
        acc.update(ref[s : s + 37], trial[s : s + 37], "ordinary" if s < 500 else "edge")
    streamed = acc.result()
    for key in ("elements", "failing", "nonfinite_trial_only", "max_abs", "p99_abs", "max_rel", "p99_rel", "min_passing_atol", "min_passing_rtol"):
        assert streamed[key] == whole[key], key
    assert streamed["mean_abs"] == pytest.approx(whole["mean_abs"], rel=1e-6)  # float32 sums per slice
    assert sum(k["elements"] for k in streamed["per_kind"].values()) == 7000
    finite = ~torch.isnan(trial)
    gaps = (trial[finite].double() - ref[finite].double()).abs()
    assert streamed["p99_abs"] == pytest.approx(float(gaps.sort().values[math.ceil(0.99 * gaps.numel()) - 1]), rel=1e-6)


def test_stream_quantile_exact_and_sketch_bound():
    g = torch.Generator().manual_seed(2)
    v = torch.rand(200_000, generator=g).pow(3) * 10
    exact = numerics.quantile(v, 0.99)
    assert exact == float(v.sort().values[math.ceil(0.99 * v.numel()) - 1])
    q = numerics.StreamQuantile(0.99, v.numel())
    for part in v.split(7_919):
        q.update(part)
    assert q.exact and q.result() == exact
    sketch = numerics.StreamQuantile(0.99, v.numel(), max_exact=10)  # forced past the exact budget
    for part in v.split(7_919):
        sketch.update(part)
    assert not sketch.exact
    assert abs(sketch.result() - exact) <= numerics.SKETCH_ALPHA * exact * 1.0001
    assert numerics.quantile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_per_token_flips_kl_and_agreement():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4, 6, 50, generator=g) * 3
    trial = ref + torch.randn(4, 6, 50, generator=g) * 1e-3
    # one token flips hard: the trial's best class moves
    j = int(ref[1, 2].argmax())
    trial[1, 2, j] -= 20
    targets = ref.argmax(-1)
    targets[0, :2] = numerics.IGNORE_INDEX
    f = numerics.classification_flips([f"ordinary/{i}" for i in range(4)], ["ordinary"] * 4, ref, trial, "lowest_index", 0.0, targets=targets)
    assert f["unit"] == "token" and f["cases"] == 22
    assert f["flips"] == 1 and f["flip_list"][0]["position"] == 2 and f["flip_list"][0]["id"] == "ordinary/1"
    d = f["distribution"]
    # reference KL computed in float64 the textbook way
    lp_r = torch.log_softmax(ref.double(), -1)
    lp_t = torch.log_softmax(trial.double(), -1)
    kl = (lp_r.exp() * (lp_r - lp_t)).sum(-1)
    valid = targets != -100
    assert d["kl_mean"] == pytest.approx(float(kl[valid].mean()), rel=1e-4)
    assert d["kl_max"] == pytest.approx(float(kl[valid].max()), rel=1e-4)
    assert d["top1_agreement"] == pytest.approx(21 / 22)
    assert 0.0 < d["top_k_overlap"] <= 1.0


def test_kl_is_accurate_for_tiny_divergences():
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(64, 32000, generator=g) * 4 + 10  # logits far from 0: naive lse differences cancel
    trial = (ref.half().float())  # real FP16 rounding of the logits
    kl = numerics.kl_per_position(ref, trial)
    lp_r = torch.log_softmax(ref.double(), -1)
    lp_t = torch.log_softmax(trial.double(), -1)
    truth = (lp_r.exp() * (lp_r - lp_t)).sum(-1)
    assert torch.allclose(kl, truth, rtol=1e-3, atol=1e-12)
    assert float(numerics.kl_per_position(ref, ref).max()) == 0.0


def test_margins_in_probability_mean_the_same_at_every_scale():
    base = torch.tensor([[2.0, 1.9, 0.0]])
    for scale in (1.0, 100.0):
        labels, m = numerics.decisions(base * scale, "lowest_index", "logit")
        assert float(m[0]) == pytest.approx(0.1 * scale)
    _, p_small = numerics.decisions(torch.tensor([[0.02, 0.0]]), "lowest_index", "probability")
    assert float(p_small[0]) == pytest.approx(math.tanh(0.01), rel=1e-6)  # p1 - p2 of two logits 0.02 apart
    _, rel = numerics.decisions(base * 100, "lowest_index", "relative")
    _, rel1 = numerics.decisions(base, "lowest_index", "relative")
    assert float(rel[0]) == pytest.approx(float(rel1[0]))


def test_real_sample_near_boundary_is_never_unreported():
    """The digits case: a real sample with a small margin flips; it is counted, not hidden among boundary cases."""
    ref = torch.tensor([[0.0, 5.0, 4.963], [1.0, 0.0, 0.0], [0.50, 0.49, 0.0]])
    trial = torch.tensor([[0.0, 4.96, 4.963], [1.0, 0.0, 0.0], [0.49, 0.50, 0.0]])
    f = numerics.classification_flips(["ordinary/digits-1274", "ordinary/b", "boundary/x~y"], ["ordinary", "ordinary", "boundary"], ref, trial,
                                      "lowest_index", 0.05)
    assert f["near_boundary_flips"] == 1 and f["boundary_flips"] == 1 and f["flips"] == 0 and f["real_flips"] == 1
    assert [r["id"] for r in f["flip_list"] if not r["boundary"]] == ["ordinary/digits-1274"]


def test_quality_metrics():
    scores = torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]])
    y = torch.tensor([1, 0])
    assert numerics.quality("classification", scores, y, "lowest_index", "accuracy") == 0.5
    assert numerics.quality("classification", scores, y, "lowest_index", "top_k", top_k=2) == 1.0
    pred, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[1.0], [1.0]])
    assert numerics.quality("regression", pred, target, "lowest_index", "neg_mae") == -1.0
    # per token: token accuracy and perplexity over targets != -100
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    tokens = torch.tensor([[0, 0, -100]])
    acc = numerics.QualityStats("accuracy", "lowest_index")
    acc.update(logits, tokens)
    assert acc.result() == 1.0
    assert acc.perplexity() == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.9)) / 2))


def test_noise_floor_band_is_on_the_curves():
    ref = [2.0, 1.5, 1.0]
    rep = [2.0, 1.51, 1.02]
    amp = [2.0, 1.53, 1.05]
    g = numerics.trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep, noise_multiple=2.0, noise_atol=0.0)
    n = g["noise"]
    assert n["replicate_gap"] == pytest.approx([0.0, 0.01, 0.02])
    # mean 0.0267 > 2 x 0.01 and largest 0.05 > 2 x 0.02: both curve statistics fail; the largest gap is at step 2
    assert n["violations"] == 2 and n["over"] == ["mean", "max"] and n["first_violation_step"] == 2
    ok = numerics.trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep, noise_multiple=3.0, noise_atol=0.001)
    assert ok["noise"]["violations"] == 0
    # One replicate step that happens to match the reference does not fail a step-by-step band that it cannot measure.
    crossing = numerics.trajectory_gap(ref, [2.01, 1.52, 1.03], 1.0, 0.0, replicate_loss=[2.02, 1.5, 1.04], noise_multiple=3.0)
    assert crossing["noise"]["violations"] == 0
    assert "violations" in numerics.trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep)["noise"]


def test_per_token_nonfinite_trial_is_infinite_kl_and_a_flip():
    ref = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]])
    trial = ref.clone()
    trial[0, 1, 0] = math.nan
    f = numerics.classification_flips(["ordinary/a"], ["ordinary"], ref, trial, "lowest_index", 0.0, targets=torch.tensor([[0, 1]]))
    assert f["flips"] == 1 and f["flip_list"][0]["position"] == 1 and f["flip_list"][0]["trial_class"] == -2
    assert f["distribution"]["kl_max"] == math.inf and f["distribution"]["top1_agreement"] == 0.5


def test_labels_of_agrees_with_decisions():
    g = torch.Generator().manual_seed(9)
    s = torch.randint(0, 3, (200, 4), generator=g).float()  # many ties
    s[5, 2] = math.nan
    for rule in ("lowest_index", "tie_is_flip"):
        assert torch.equal(numerics.labels_of(s, rule), numerics.decisions(s, rule)[0])


def test_histogram_quantile_bound_zeros_negatives_and_chunking():
    """Past MAX_EXACT the p99 comes from a float32 bit-pattern histogram: within SKETCH_ALPHA of the exact
    nearest rank, never above the exact max, the same for any chunking; zeros, tiny and negative values."""
    g = torch.Generator().manual_seed(11)
    v = torch.cat([torch.rand(50_000, generator=g).pow(4) * 1e3, torch.zeros(3_000), torch.full((500,), 1e-45), -torch.rand(100, generator=g)])
    v = v[torch.randperm(v.numel(), generator=g)]
    for q in (0.5, 0.9, 0.99, 0.999, 1.0):
        exact = numerics.quantile(v, q)
        answers = set()
        for size in (997, 8192, v.numel()):
            sketch = numerics.StreamQuantile(q, v.numel(), max_exact=0)
            for part in v.split(size):
                sketch.update(part.double())  # float64 in: rounded to float32, far below the bound
            assert not sketch.exact
            answers.add(sketch.result())
        assert len(answers) == 1
        got = answers.pop()
        assert got <= float(v.max()) and abs(got - exact) <= numerics.SKETCH_ALPHA * abs(exact) + numerics.HIST_FLOOR
    only_negative = numerics.StreamQuantile(0.99, 100, max_exact=0)
    only_negative.update(-torch.arange(1.0, 101.0))
    assert only_negative.result() == numerics.quantile(-torch.arange(1.0, 101.0), 0.99) == -2.0  # kept exactly
    top = numerics.StreamQuantile(1.0, 1000, max_exact=0)
    top.update(torch.full((1000,), 0.3))
    assert top.result() <= float(torch.tensor(0.3)) and top.result() == pytest.approx(0.3, rel=numerics.SKETCH_ALPHA)


def test_failing_count_at_the_threshold_is_the_exact_test():
    """Elements within float32 rounding of atol + rtol |r|: counted as the float64 test counts them."""
    g = torch.Generator().manual_seed(12)
    r = torch.randn(300_000, generator=g) * 10
    atol, rtol = 0.05, 0.02
    bound = atol + rtol * r.double().abs()
    t = (r.double() + bound * (1 + torch.randn(r.shape, generator=g, dtype=torch.float64) * 1e-7) * torch.sign(torch.randn(r.shape, generator=g, dtype=torch.float64))).float()
    expected = int(((t.double() - r.double()).abs() > atol + rtol * r.double().abs()).sum())
    assert 0 < expected < r.numel()
    acc = numerics.GapStats(atol, rtol, r.numel())
    for a, b in zip(r.split(1 << 14), t.split(1 << 14)):
        acc.update(a, b)
    assert acc.result()["failing"] == expected


def test_log_sum_exps_from_the_kl_pieces_match_float64():
    """Per token, the perplexity of reference and trial uses the log-sum-exps ``kl_and_lse`` derives (no extra
    pass): equal to float64's, near and far apart (a shuffled trial row takes the direct logsumexp)."""
    g = torch.Generator().manual_seed(13)
    ref = torch.randn(6, 9, 500, generator=g) * 4
    trial = ref.to(torch.bfloat16).float()
    trial[2, 3] = trial[2, 3][torch.randperm(500, generator=g)]  # far apart
    kl, lse_r, lse_t = numerics.kl_and_lse(ref, trial, ref_argmax=ref.argmax(-1))
    assert torch.allclose(lse_r, torch.logsumexp(ref.double(), -1), rtol=0, atol=1e-5)
    assert torch.allclose(lse_t, torch.logsumexp(trial.double(), -1), rtol=0, atol=1e-5)
    assert torch.equal(kl, numerics.kl_per_position(ref, trial))
    y = torch.randint(0, 500, (6, 9), generator=g)
    y[0, :4] = numerics.IGNORE_INDEX
    for side, scores, lse in (("reference", ref, lse_r), ("trial", trial, lse_t)):
        fast, plain = numerics.QualityStats("accuracy", "lowest_index"), numerics.QualityStats("accuracy", "lowest_index")
        fast.update(scores, y, lse=lse)
        plain.update(scores, y)
        valid = y != numerics.IGNORE_INDEX
        nll = (torch.logsumexp(scores.double(), -1) - scores.double().gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1))[valid]
        assert fast.perplexity() == pytest.approx(math.exp(float(nll.mean())), rel=1e-6), side
        assert plain.perplexity() == pytest.approx(fast.perplexity(), rel=1e-6), side


def test_kl_ignores_classes_the_reference_rules_out():
    """A masked vocabulary (-inf logits in the reference): identical outputs have KL 0, not inf."""
    ref = torch.tensor([[0.0, 1.0, -math.inf], [2.0, -math.inf, 0.5]])
    assert numerics.kl_and_lse(ref, ref.clone())[0].tolist() == [0.0, 0.0]
    near = numerics.kl_and_lse(ref, torch.tensor([[0.0, 1.0, -30.0], [2.0, -40.0, 0.5]]))[0]
    assert bool((near >= 0).all()) and float(near.max()) < 1e-12
    # a class the reference gives mass to and the trial rules out: infinitely far, as KL says
    assert numerics.kl_and_lse(ref, torch.tensor([[0.0, -math.inf, 3.0], [2.0, 0.0, 0.5]]))[0][0] == math.inf


def test_an_eval_target_outside_the_classes_is_one_line_not_an_index_error():
    from pipeline.errors import UserError

    stats = numerics.QualityStats("accuracy", "lowest_index")
    scores = torch.randn(2, 3, 5)
    with pytest.raises(UserError, match="eval target is 7 but the model scores 5 classes"):
        stats.update(scores, torch.tensor([[1, -100, 7], [0, 2, 4]]))
    stats.update(scores, torch.tensor([[1, -100, 4], [0, 2, 4]]))  # -100 is ignored, not out of range
