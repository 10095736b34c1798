"""Decisions compared on hand-built scores: ties, margins, flips near and at the boundary, per-token KL, NaN."""

import math

import pytest
import torch

from pipeline.compare.decisions import (DecisionStats, best_two, first_max, kl_and_lse, labels_of, listed_top, regression_flips,
                                        rate_sample, sign_flips, top_k)
from pipeline.compare.gaps import value_gaps
from pipeline.compare.quality import QualityStats
from pipeline.task import IGNORE_INDEX


def _decide(ids, kinds, ref, trial, tie_rule="lowest_index", boundary_margin=0.0, margin_kind="logit",
            targets=None) -> DecisionStats:
    """``DecisionStats`` fed the whole pair at once (compare feeds it slice by slice: the same counts)."""
    stats = DecisionStats(ids, kinds, tie_rule, boundary_margin, margin_kind, capacity_tokens=ref[..., 0].numel())
    stats.update(0, ref, trial, targets)
    return stats


def _ordinary(n):
    return [f"ordinary/{i}" for i in range(n)], ["ordinary"] * n


def test_worked_example_from_the_guide_tiny_gap_flips_the_decision():
    """Scores 1.0000 and 1.0003: FP16 cannot tell them apart (spacing near 1 is 2**-10), the tie
    goes to the lowest index, and the decision flips although the value gap is 3e-4."""
    ref = torch.tensor([[1.0000, 1.0003]])
    trial = ref.half().float()  # allowed: rounds two scores to FP16, the guide's worked example
    assert trial[0, 0] == trial[0, 1]  # real FP16 rounding, not a hand-made tie
    gap = value_gaps(ref, trial, atol=1e-3, rtol=0.0)
    assert gap.failing == 0  # within a 1e-3 tolerance...
    flips = _decide(["ordinary/x"], ["ordinary"], ref, trial).result()
    assert flips.flips == 1  # ...yet the action changes
    assert flips.flip_list[0].reference_class == 1 and flips.flip_list[0].trial_class == 0
    # With a boundary margin above the reference margin (3e-4) the same flip of a REAL sample is a
    # near-boundary flip: counted apart from constructed boundary cases, never silently allowed.
    flips = _decide(["ordinary/x"], ["ordinary"], ref, trial, boundary_margin=1e-3).result()
    assert flips.flips == 0 and flips.near_boundary_flips == 1 and flips.boundary_flips == 0
    assert flips.flip_list[0].near_boundary and not flips.flip_list[0].boundary


def test_tie_rules():
    scores = torch.tensor([[2.0, 2.0, 1.0], [0.0, 3.0, 3.0], [1.0, 0.0, 0.0]])
    lowest = _decide(*_ordinary(3), scores, scores)
    assert lowest.per_case().reference_class.tolist() == [0, 1, 0]
    assert lowest.per_case().margin.tolist() == [0.0, 0.0, 1.0]
    tie = _decide(*_ordinary(3), scores, scores, "tie_is_flip")
    assert tie.per_case().reference_class.tolist() == [-1, -1, 0]
    assert tie.result().flips == 0  # the same ties on both sides


def test_tie_is_flip_counts_a_new_tie_as_a_flip_even_when_lowest_index_would_agree():
    ref = torch.tensor([[2.0, 1.9]])
    trial = torch.tensor([[2.0, 2.0]])
    assert _decide(["a"], ["ordinary"], ref, trial, "lowest_index").result().flips == 0
    assert _decide(["a"], ["ordinary"], ref, trial, "tie_is_flip").result().flips == 1


def test_nan_scores_never_match_a_decision():
    ref = torch.tensor([[1.0, 0.0]])
    trial = torch.tensor([[math.nan, 0.0]])
    flips = _decide(["a"], ["edge"], ref, trial).result()
    assert flips.flips == 1 and flips.flip_list[0].trial_class == -2


def test_boundary_flips_are_counted_apart():
    ref = torch.tensor([[1.0, 0.99], [5.0, 0.0], [0.0, 0.02]])
    trial = torch.tensor([[0.98, 0.99], [0.0, 5.0], [0.0, 0.02]])
    f = _decide(["b", "o", "c"], ["boundary", "ordinary", "ordinary"], ref, trial, boundary_margin=0.05).result()
    assert f.boundary_cases == 1  # the constructed one
    assert f.near_boundary_cases == 1  # the real sample of margin 0.02
    assert f.boundary_flips == 1 and f.flips == 1 and f.near_boundary_flips == 0
    assert f.boundary_flip_fraction == 1.0


def test_real_sample_near_boundary_is_never_unreported():
    """The digits case: a real sample with a small margin flips; it is counted, not hidden among boundary cases."""
    ref = torch.tensor([[0.0, 5.0, 4.963], [1.0, 0.0, 0.0], [0.50, 0.49, 0.0]])
    trial = torch.tensor([[0.0, 4.96, 4.963], [1.0, 0.0, 0.0], [0.49, 0.50, 0.0]])
    f = _decide(["ordinary/digits-1274", "ordinary/b", "boundary/x~y"], ["ordinary", "ordinary", "boundary"], ref, trial,
                boundary_margin=0.05).result()
    assert f.near_boundary_flips == 1 and f.boundary_flips == 1 and f.flips == 0 and f.real_flips == 1
    assert [r.id for r in f.flip_list if not r.boundary] == ["ordinary/digits-1274"]


def test_a_margin_read_from_probabilities_is_named_a_probability_margin():
    """Under ``boundary_margin_kind: logit`` the margin of an output of probabilities is p1 - p2: the record (and the
    rule's reason, which reads it) names the unit measured, not the setting."""
    ref = torch.tensor([[0.51, 0.49], [0.9, 0.1]])
    trial = torch.tensor([[0.49, 0.51], [0.9, 0.1]])
    f = _decide(["ordinary/a", "ordinary/b"], ["ordinary", "ordinary"], ref, trial, boundary_margin=0.05).result()
    assert f.margin_kind == "probability" and [r.margin_kind for r in f.flip_list] == ["probability"]
    assert f.near_boundary_flips == 1
    logits = _decide(["ordinary/a", "ordinary/b"], ["ordinary", "ordinary"], ref * 3, trial * 3, boundary_margin=0.1)
    assert logits.result().margin_kind == "logit"  # rows that do not sum to 1: scores, whatever their range


def test_regression_flips_across_threshold():
    ref = torch.tensor([[0.9], [1.1], [2.0]])
    trial = torch.tensor([[1.0], [1.1], [1.9]])
    f = regression_flips(["a", "b", "c"], ["ordinary"] * 3, ref, trial, threshold=1.0)
    assert f.flips == 1 and f.flip_list[0].id == "a"
    assert regression_flips(["a"], ["ordinary"], ref[:1], trial[:1], None).flips == 0


def test_a_regression_threshold_judges_every_value_of_a_case_not_its_first():
    """A case of [N, 3] values (a multi-label head's logits, threshold 0) flips where any label crosses, whatever its
    column: the verdict must not depend on the order of the columns. The flip shows the crossing value."""
    ref = torch.tensor([[0.5, -0.2, 0.3], [0.5, 0.2, 0.3], [-1.0, -1.0, -1.0]])
    trial = torch.tensor([[0.5, 0.1, 0.3], [0.4, 0.2, 0.3], [-1.0, -1.0, -0.9]])
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        f = regression_flips(["a", "b", "c"], ["ordinary"] * 3, ref[:, order], trial[:, order], threshold=0.0)
        assert f.flips == 1 and f.flip_list[0].id == "a"
        assert (f.flip_list[0].reference, f.flip_list[0].trial) == pytest.approx((-0.2, 0.1))


def test_a_padded_position_crossing_the_threshold_is_no_flip():
    """Per-token regression values [N, T, 1], left padding: only a padded position crosses (position 0 of the first
    case), so no case flips; a kept position that crosses does."""
    from pipeline.compare.streams import _threshold_pick

    r = torch.tensor([[[0.4], [0.1], [0.2]], [[0.1], [0.2], [0.3]]])
    t = torch.tensor([[[0.6], [0.1], [0.2]], [[0.1], [0.2], [0.3]]])
    valid = torch.tensor([[False, True, True], [True, True, True]])
    picked = [v[:, None] for v in _threshold_pick(r, t, 0.5, valid)[:2]]
    assert regression_flips(["a", "b"], ["ordinary"] * 2, *picked, 0.5).flips == 0
    t[1, 2, 0] = 0.7
    picked = [v[:, None] for v in _threshold_pick(r, t, 0.5, valid)[:2]]
    f = regression_flips(["a", "b"], ["ordinary"] * 2, *picked, 0.5)
    assert f.flips == 1 and f.flip_list[0].id == "b" and f.flip_list[0].trial == pytest.approx(0.7)


def test_margins_in_probability_mean_the_same_at_every_scale():
    base = torch.tensor([[2.0, 1.9, 0.0]])

    def margin(scores, kind):
        return float(_decide(["a"], ["ordinary"], scores, scores, margin_kind=kind).per_case().margin[0])

    for scale in (1.0, 100.0):
        assert margin(base * scale, "logit") == pytest.approx(0.1 * scale)
    # p1 - p2 of two logits 0.02 apart
    assert margin(torch.tensor([[0.02, 0.0]]), "probability") == pytest.approx(math.tanh(0.01), rel=1e-6)
    assert margin(base * 10, "relative") == pytest.approx(margin(base, "relative"))
    # A class more than 104 below the maximum (probability 0, like a masked one) is no score of the row's spread.
    assert margin(base * 100, "relative") == pytest.approx(margin(base[:, :2] * 100, "relative"))


def test_labels_of_agrees_with_the_decisions_compared():
    g = torch.Generator().manual_seed(9)
    s = torch.randint(0, 3, (200, 4), generator=g).float()  # many ties
    s[5, 2] = math.nan
    for rule in ("lowest_index", "tie_is_flip"):
        assert torch.equal(labels_of(s, rule), _decide(*_ordinary(200), s, s, rule).per_case().reference_class)


def test_per_token_flips_kl_and_agreement():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4, 6, 50, generator=g) * 3
    trial = ref + torch.randn(4, 6, 50, generator=g) * 1e-3
    # one token flips hard: the trial's best class moves
    j = int(ref[1, 2].argmax())
    trial[1, 2, j] -= 20
    targets = ref.argmax(-1)
    targets[0, :2] = IGNORE_INDEX
    stats = _decide(*_ordinary(4), ref, trial, targets=targets)
    f, d = stats.result(), stats.distribution()
    assert f.unit == "token" and f.cases == 22
    assert f.flips == 1 and f.flip_list[0].position == 2 and f.flip_list[0].id == "ordinary/1"
    # reference KL computed in float64 the textbook way
    lp_r = torch.log_softmax(ref.double(), -1)
    lp_t = torch.log_softmax(trial.double(), -1)
    kl = (lp_r.exp() * (lp_r - lp_t)).sum(-1)
    valid = targets != IGNORE_INDEX
    assert d.kl_mean == pytest.approx(float(kl[valid].mean()), rel=1e-4)
    assert d.kl_max == pytest.approx(float(kl[valid].max()), rel=1e-4)
    assert d.top1_agreement == pytest.approx(21 / 22)
    assert 0.0 < d.top_k_overlap <= 1.0



def test_a_token_whose_trial_scores_are_nan_overlaps_no_class_of_the_reference():
    """Top-k overlap: a NaN among the trial's k best ranks no class (which NaNs ``topk`` keeps is its own, and differs
    between the CPU and a GPU): a token of NaN scores overlaps nothing, a token with one NaN loses that slot alone."""
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(2, 3, 40, generator=g) * 3
    ref[0, 1, 25:30] += 20  # its best five are the classes topk keeps on this CPU from a row of NaNs
    trial = ref.clone()
    trial[0, 1] = math.nan
    best = ref[1, 2].argsort(descending=True)
    trial[1, 2, best[-1]] = math.nan  # the worst class becomes NaN: it enters the trial's top 5, pushing out its 5th
    d = _decide(*_ordinary(2), ref, trial).distribution()
    assert d.top_k_overlap == pytest.approx((4 * 1.0 + 0.0 + 4 / 5) / 6)

def test_per_token_nonfinite_trial_is_infinite_kl_and_a_flip():
    ref = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]])
    trial = ref.clone()
    trial[0, 1, 0] = math.nan
    stats = _decide(["ordinary/a"], ["ordinary"], ref, trial, targets=torch.tensor([[0, 1]]))
    f = stats.result()
    assert f.flips == 1 and f.flip_list[0].position == 1 and f.flip_list[0].trial_class == -2
    assert stats.distribution().kl_max == math.inf and stats.distribution().top1_agreement == 0.5


def test_kl_is_accurate_for_tiny_divergences():
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(64, 32000, generator=g) * 4 + 10  # logits far from 0: naive lse differences cancel
    trial = (ref.half().float())  # allowed: real FP16 rounding of the logits (a tensor, not a model)
    kl = kl_and_lse(ref, trial)[0]
    lp_r = torch.log_softmax(ref.double(), -1)
    lp_t = torch.log_softmax(trial.double(), -1)
    truth = (lp_r.exp() * (lp_r - lp_t)).sum(-1)
    assert torch.allclose(kl, truth, rtol=1e-3, atol=1e-12)
    assert float(kl_and_lse(ref, ref)[0].max()) == 0.0


def test_log_sum_exps_from_the_kl_pieces_match_float64():
    """Per token, the perplexity of reference and trial uses the log-sum-exps ``kl_and_lse`` derives (no extra
    pass): equal to float64's, near and far apart (a shuffled trial row takes the direct logsumexp)."""
    g = torch.Generator().manual_seed(13)
    ref = torch.randn(6, 9, 500, generator=g) * 4
    trial = ref.to(torch.bfloat16).float()
    trial[2, 3] = trial[2, 3][torch.randperm(500, generator=g)]  # far apart
    kl, lse_r, lse_t = kl_and_lse(ref, trial, ref_argmax=ref.argmax(-1))
    assert torch.allclose(lse_r, torch.logsumexp(ref.double(), -1), rtol=0, atol=1e-5)
    assert torch.allclose(lse_t, torch.logsumexp(trial.double(), -1), rtol=0, atol=1e-5)
    assert torch.equal(kl, kl_and_lse(ref, trial)[0])
    y = torch.randint(0, 500, (6, 9), generator=g)
    y[0, :4] = IGNORE_INDEX
    for side, scores, lse in (("reference", ref, lse_r), ("trial", trial, lse_t)):
        fast, plain = QualityStats("accuracy", "lowest_index"), QualityStats("accuracy", "lowest_index")
        fast.update(scores, y, lse=lse)
        plain.update(scores, y)
        valid = y != IGNORE_INDEX
        nll = (torch.logsumexp(scores.double(), -1) - scores.double().gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1))[valid]
        assert fast.perplexity() == pytest.approx(math.exp(float(nll.mean())), rel=1e-6), side
        assert plain.perplexity() == pytest.approx(fast.perplexity(), rel=1e-6), side


def test_kl_ignores_classes_the_reference_rules_out():
    """A masked vocabulary (-inf logits in the reference): identical outputs have KL 0, not inf."""
    ref = torch.tensor([[0.0, 1.0, -math.inf], [2.0, -math.inf, 0.5]])
    assert kl_and_lse(ref, ref.clone())[0].tolist() == [0.0, 0.0]
    near = kl_and_lse(ref, torch.tensor([[0.0, 1.0, -30.0], [2.0, -40.0, 0.5]]))[0]
    assert bool((near >= 0).all()) and float(near.max()) < 1e-12
    # a class the reference gives mass to and the trial rules out: infinitely far, as KL says
    assert kl_and_lse(ref, torch.tensor([[0.0, -math.inf, 3.0], [2.0, 0.0, 0.5]]))[0][0] == math.inf


@pytest.mark.parametrize("shape, k", [((300, 1000), 2), ((7, 65, 4000), 5), ((3, 5, 4003), 5), ((40, 2048), 2)])
def test_fast_paths_give_topk_and_max(shape, k):
    """``first_max`` is ``max(dim=-1)``, ``best_two`` and ``top_k`` give ``topk``'s values and set of indices, with
    ties (bfloat16 scores), NaN and infinities."""
    g = torch.Generator().manual_seed(3)
    for variant in range(4):
        s = torch.randn(shape, generator=g) * 3
        if variant == 1:
            s = s.to(torch.bfloat16).float()  # many ties among the best
        if variant == 2:
            s.view(-1)[::97] = math.nan
        if variant == 3:
            s[..., 5] = s.max()
            s[..., -1] = math.inf
        values, index = first_max(s)
        want = s.max(dim=-1)
        assert torch.equal(values.nan_to_num(7.0), want.values.nan_to_num(7.0))
        assert torch.equal(index[~want.values.isnan()], want.indices[~want.values.isnan()])
        fast = best_two(s) if k == 2 and s.ndim == 2 else top_k(s, k)
        top = s.topk(k, dim=-1)
        assert torch.equal(fast[0].nan_to_num(7.0), top.values.nan_to_num(7.0))
        assert torch.equal(s.gather(-1, fast[1]).nan_to_num(7.0), fast[0].nan_to_num(7.0))
        if k > 2:
            assert torch.equal(fast[1].sort(-1).values, top.indices.sort(-1).values)


def test_sign_flips_count_like_class_scores():
    """A single logit z is the two-class scores (0, z): its margin is |z| (|tanh(z / 2)| in probability), constructed
    boundary cases are counted apart, and a real case crossing 0 within the margin is a near-boundary flip."""
    ids = ["ordinary/0", "ordinary/1", "ordinary/2", "boundary/3", "edge/4"]
    kinds = [i.split("/")[0] for i in ids]
    ref = torch.tensor([2.0, 0.01, -1.0, 0.001, 0.0])
    trial = torch.tensor([-0.1, -0.01, -1.2, -0.001, 0.0])  # case 4: 0 stays on the >= 0 side
    d = sign_flips(ids, kinds, ref, trial, boundary_margin=0.05, margin_kind="logit")
    assert (d.flips, d.near_boundary_flips, d.boundary_flips, d.real_flips) == (1, 1, 1, 2)
    assert (d.cases, d.boundary_cases, d.near_boundary_cases) == (5, 1, 2)
    assert [(f.id, f.reference_class, f.trial_class, f.near_boundary) for f in d.flip_list] == [
        ("ordinary/0", 1, 0, False), ("ordinary/1", 1, 0, True), ("boundary/3", 1, 0, False)]
    p = sign_flips(ids, kinds, ref, trial, boundary_margin=0.8, margin_kind="probability")  # tanh(1) = 0.76 < 0.8
    assert (p.flips, p.near_boundary_flips) == (0, 2) and p.flip_list[0].reference_margin == pytest.approx(math.tanh(1.0))


def test_a_listed_flip_names_its_best_classes_in_one_order_on_every_device():
    """A flip's top 5 (a vocabulary's scores): NaN first, then by value, equal values by the lowest class; ``topk``'s
    own order among equal values differs between the CPU and a GPU (an all-NaN row listed 28 first on one, 1 on the
    other)."""
    nan = math.nan
    s = torch.tensor([1.0, 3.0, 3.0, nan, 2.0, 3.0, 0.0, nan] + [0.0] * 20)
    values, classes = listed_top(s, 5)
    assert classes.tolist() == [3, 7, 1, 2, 5] and values[2:].tolist() == [3.0, 3.0, 3.0]
    assert listed_top(torch.full((30,), nan), 5)[1].tolist() == [0, 1, 2, 3, 4]
    assert listed_top(torch.zeros(30), 5)[1].tolist() == [0, 1, 2, 3, 4]
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(listed_top(x, 5), x.topk(5)))


def test_a_listed_flip_without_a_tie_at_its_kth_best_takes_the_short_way_to_the_same_order():
    """Rows rounded to bfloat16 (equal values among the 5 best, at the 5th and 6th, or neither): the classes by value,
    equal values by the lowest class, whether the row takes ``topk``'s 5 directly or the candidates at the 5th best."""
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        s = (torch.randn(64, generator=g) * 3).to(torch.bfloat16).float()
        values, classes = listed_top(s, 5)
        expected = sorted(range(64), key=lambda c: (-float(s[c]), c))[:5]
        assert classes.tolist() == expected and values.tolist() == [float(s[c]) for c in expected]
    short = torch.tensor([5.0, 1.0, 5.0, 4.0, 3.0, 3.0, 2.0, 0.0])  # equal values within the 5 best, none at the 5th
    assert listed_top(short, 5)[1].tolist() == [0, 2, 3, 4, 5]


def test_the_rate_sample_is_the_ordinary_units_and_a_copy_adds_only_the_flips_its_twin_lacks():
    """``rate_sample``: per token, ordinary/a's 3 flipped tokens and its selected copy's 4 are at least 4 changes (the
    same input, one change where both show it), the edge case's 2 add, the constructed boundary case's never count;
    the units are the ordinary cases' alone, and a count above them is capped (no rate above 1)."""
    ids = ["ordinary/a", "ordinary/b", "selected/a", "edge/zeros", "boundary/a~b", "selected/gone"]
    kinds = [i.partition("/")[0] for i in ids]
    assert rate_sample(ids, kinds, [3, 0, 4, 2, 5, 1], [10, 8, 10, 6, 9, 7]) == (18, 3 + 1 + 2 + 1)
    assert rate_sample(ids, kinds, [3, 0, 2, 0, 5, 0], [10, 8, 10, 6, 9, 7]) == (18, 3)  # the copy's flips are its twin's
    assert rate_sample(ids[:1] + ids[3:4], kinds[:1] + kinds[3:4], [1, 6], [1, 1]) == (1, 1)


def test_tie_is_flip_holds_for_a_regression_threshold_as_for_a_single_logit():
    """Under ``tie_is_flip`` a value exactly at a regression's threshold on one side only is a flip, as a single logit's
    exact 0 is; ``>=`` alone read 2.0 against 2.019 as the same decision."""
    ref = torch.tensor([[2.019], [2.0], [1.5]])
    trial = torch.tensor([[2.0], [2.001], [1.5]])
    ids = ["a", "b", "c"]
    assert regression_flips(ids, ["ordinary"] * 3, ref, trial, 2.0, 0.05, "logit").real_flips == 0
    f = regression_flips(ids, ["ordinary"] * 3, ref, trial, 2.0, 0.05, "logit", tie_rule="tie_is_flip")
    assert f.real_flips == 2 and sorted(x.id for x in f.flip_list) == ["a", "b"]


@pytest.mark.parametrize("per_token", [False, True], ids=["classification", "per_token"])
@pytest.mark.parametrize("at", ["torch", "kernel", "between"])
def test_a_probability_margin_at_the_boundary_is_near_or_clear_alike_with_and_without_the_kernels(per_token, at):
    """The kernels' log-sum-exp (float64 sum) and torch's (float32) differ by float32 rounding, so p1 - p2 does by
    ~5e-7 of itself: a ``boundary_margin`` between the two, or at either, must not count a flip near on one path and
    clear on the other (``settled_margins``: torch decides the slices within rounding of the boundary)."""
    from pipeline.compare import native
    from pipeline.compare.decisions import _top, best_rows, margins

    assert native.available()
    g = torch.Generator().manual_seed(7)
    ref = torch.randn(64, 100, generator=g) * 2
    trial = ref.clone()
    order = ref.argsort(-1, descending=True)
    first, second = order[:, 0:1], order[:, 1:2]
    trial.scatter_(1, first, ref.gather(1, second))  # the best two swapped: every case flips
    trial.scatter_(1, second, ref.gather(1, first))
    kernel = best_rows(ref, 2, True)
    mk = margins(kernel[:2], "probability", kernel[2])
    _, top, lse = _top(ref, 2, "lowest_index", True)
    mt = margins(top, "probability", lse)
    row = int((mk - mt).abs().argmax())
    lo, hi = sorted((float(mk[row]), float(mt[row])))
    assert lo < hi  # the two paths do disagree on this margin
    boundary = {"torch": float(mt[row]), "kernel": float(mk[row]), "between": (lo + hi) / 2}[at]
    if per_token:  # [cases, positions, classes]: the rows go through decide_rows
        ref, trial = ref.view(8, 8, 100), trial.view(8, 8, 100)
    ids, kinds = _ordinary(ref.shape[0])
    results = []
    for kernels in (False, True):
        stats = DecisionStats(ids, kinds, "lowest_index", boundary, "probability", ref[..., 0].numel(), kernels=kernels)
        stats.update(0, ref, trial)
        d = stats.result()
        results.append((d.flips, d.near_boundary_flips, d.near_boundary_cases,
                        [(f.id, f.position, f.near_boundary, f.reference_margin) for f in d.flip_list],
                        stats._case.margin.tolist()))
    assert results[0] == results[1]
    assert results[0][0] + results[0][1] == 64 and results[0][1] >= 1
