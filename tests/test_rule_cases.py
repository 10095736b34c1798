"""Sound verdicts: adversarial cases whose right answer follows from the guide, on real models under real autocast.

Each test builds the case with real torch modules (and Hugging Face classes where named), runs the project's own
compare and rule on it, and asserts the verdict the guide asks for: no false accept (a changed decision, an untested
head, a non-finite output of the AMP-trained model, a vacuous tolerance) and no false rollback (a GradScaler skip made
by design).
"""

import dataclasses
import math

import pytest
import torch

from pipeline import heads, inference, recipe, training

from pipeline import refusals, rule

from pipeline.artifacts.comparison import Decisions, Distribution, Flip, Quality
from pipeline.artifacts.steps import StepRecord
from pipeline.compare import bounds

from pipeline.compare import streams
from pipeline.compare.decisions import DecisionStats, margins
from pipeline.compare.quality import QualityStats
from pipeline.compare.quantiles import StreamQuantile, quantile
from pipeline.compare.trajectory import trajectory_gap, update_health
from pipeline.config import AcceptanceConfig, CompareConfig, ReferenceConfig, TaskConfig, Tolerance
from pipeline.config import Policy
from pipeline.task import Batch, TensorSource
from _steps import step

# flat trajectories here: no replicate to measure FP32 noise on
RULE = AcceptanceConfig(min_quality=None, loss_noise_multiple=None)
FLAT = [step(i) for i in range(12)]


def _vet(cfg, *facts, **named):
    """The first refusal of rule ``cfg`` against the reference's facts (``refusals.Facts``), or None."""
    return refusals.problem(cfg, refusals.Facts(*facts, **named))


def _autocast(model, x, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = model(x)
    out = out if isinstance(out, dict) else {"output": out}
    return {k: v.float() for k, v in out.items()}


def _fp32(model, x):
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, dict) else {"output": out}


def _judge(ids, y, has_target, ref, trial, trained=None, cfg=RULE, steps=FLAT, trial_steps=None, aligned=None, scaler=False):
    sources = streams.Sources(ids, y, has_target, streams.InMemory(ref), streams.InMemory(trial),
                              streams.InMemory(trained if trained is not None else trial))
    runs = streams.Trajectories(steps, trial_steps or steps, 2.0**16 if scaler else 1.0, scaler_enabled=scaler, aligned=aligned)
    stats, _ = streams.compare_streams("classification" if y.dtype == torch.long else "regression", cfg, sources, runs)
    return stats, rule.decide(stats, cfg)


def _low_confidence(n=400, classes=4, seed=0):
    """A real classifier whose every top-2 margin is below 0.05 logit: its scores are squeezed toward a tie."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, classes))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        # Every class row is one common row plus a small difference: large logits, tiny top-2 margins.
        common = torch.randn(1, 32, generator=g)
        model[2].weight.copy_(common + 0.002 * torch.randn(classes, 32, generator=g))
        model[2].bias.zero_()
    x = torch.randn(n, 16, generator=g)
    ids = [f"ordinary/s{i}" for i in range(n)]
    ref = _fp32(model, x)
    y = ref["output"].argmax(1)
    return model, x, ids, y, torch.ones(n, dtype=torch.bool), ref


def test_low_confidence_classifier_flips_are_named_and_fail_the_default_rule():
    model, x, ids, y, has_target, ref = _low_confidence()
    trial = _autocast(model, x, torch.bfloat16)
    flipped = int((trial["output"].argmax(1) != ref["output"].argmax(1)).sum())
    margins = ref["output"].topk(2, dim=1).values
    assert bool(((margins[:, 0] - margins[:, 1]) < 0.05).all()) and flipped >= 10  # the case: every sample near the boundary
    stats, d = _judge(ids, y, has_target, ref, trial, cfg=dataclasses.replace(RULE, max_quality_drop=1.0))
    assert d.decision == "rollback" and d.inference == "rollback"
    assert len(d.cases["flips"]) == flipped  # every flipped real case is named, none excused as "near the boundary"
    reason = next(r for r in d.reasons if "near the boundary" in r)
    assert d.cases["flips"][0] in reason
    # The user who tolerates flips says so in the rule, and the verdict says it in words.
    loose = dataclasses.replace(
        RULE, max_quality_drop=1.0, max_near_boundary_flips=None, outputs={"*": Tolerance(atol=10.0, rtol=0.1)}
    )
    _, d = _judge(ids, y, has_target, ref, trial, cfg=loose)
    assert d.decision == "accept" and any("not limited: the rule sets max_near_boundary_flips: null" in c for c in d.checks)


def test_a_flip_rate_is_bounded_on_the_ordinary_cases_alone_and_a_copys_flip_is_one_change():
    """Clopper–Pearson bounds a rate over independent draws of the data: the ordinary cases. ``selected/X`` is ordinary X
    again (picked for its small margin) and an edge case is built, so their cases must not narrow the bound: 290
    ordinary cases with 30 such cases beside them cannot give a confident accept at 1 % (it needs 299 draws), though
    320 counted cases would. Their flips still count against the sample, a copy's once with its twin's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).eval()
    x = torch.randn(290, 8)
    ref = _fp32(model, x)["output"]
    order = (ref.topk(2).values[:, 0] - ref.topk(2).values[:, 1]).argsort()[:20]  # the smallest margins, as prepare picks
    ids = ([f"ordinary/{i}" for i in range(290)] + [f"selected/{i}" for i in order.tolist()]
           + [f"edge/scale-10/{i}" for i in range(10)])
    ref_all = torch.cat([ref, ref[order], _fp32(model, x[:10] * 10)["output"]])
    y = torch.cat([ref.argmax(1), torch.zeros(30, dtype=torch.long)])
    has_target = torch.tensor([i < 290 for i in range(320)])
    cfg = dataclasses.replace(RULE, max_flip_rate=0.01, confidence=0.95, max_quality_drop=1.0)
    stats, d = _judge(ids, y, has_target, {"output": ref_all}, {"output": ref_all.clone()}, cfg=cfg)
    assert (stats.flips.sample, stats.flips.sample_flips) == (290, 0)
    assert d.decision == "rollback" and any("needs at least 299" in r for r in d.reasons), d.reasons
    # With enough draws: the trial swaps the top two of ordinary case a (and of its selected copy) and of one edge case.
    x = torch.randn(1200, 8)
    ref = _fp32(model, x)["output"]
    a = int(order[0])
    ids = [f"ordinary/{i}" for i in range(1200)] + [f"selected/{a}", "edge/zeros"]
    ref_all = torch.cat([ref, ref[a : a + 1], _fp32(model, torch.zeros(1, 8))["output"]])
    trial = ref_all.clone()
    for row in (a, 1200, 1201):
        top = trial[row].topk(2).indices
        trial[row, top[0]], trial[row, top[1]] = ref_all[row, top[1]], ref_all[row, top[0]]
    y = torch.cat([ref.argmax(1), torch.zeros(2, dtype=torch.long)])
    has_target = torch.tensor([i < 1200 for i in range(1202)])
    stats, d = _judge(ids, y, has_target, {"output": ref_all}, {"output": trial}, cfg=cfg)
    assert (stats.flips.sample, stats.flips.sample_flips) == (1200, 2)  # the copy's flip is its twin's; the edge's counts
    assert any("2 changed of 1200 ordinary cases" in c for c in d.checks + d.reasons), d.checks


def _swap_top2(scores: torch.Tensor) -> None:
    top = scores.topk(2).indices
    scores[top[0]], scores[top[1]] = scores[top[1]].clone(), scores[top[0]].clone()


def test_a_selected_copy_and_its_twin_changing_are_one_change_under_count_limits():
    """``selected/X`` is ordinary X again (prepare copies the real samples of smallest margin as boundary cases where
    inputs cannot be interpolated): one input whose decision changes on both rows is one change. Under
    ``max_flips: 1`` it is allowed, whether counted far from the boundary or near it, per case, per token and for a
    single-logit head alike; counted twice, one changed input rolled the trial back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).eval()
    x = torch.randn(300, 8)
    ref = _fp32(model, x)["output"]
    top = ref.topk(2).values
    order = (top[:, 0] - top[:, 1]).argsort()[:20]  # the smallest margins, as prepare picks
    a = int(order[0])
    ids = [f"ordinary/{i}" for i in range(300)] + [f"selected/{i}" for i in order.tolist()]
    gate = torch.cat([x[:, :1], x[order, :1]])  # a single-logit head beside the scores
    ref_all = {"logits": torch.cat([ref, ref[order]]), "gate_logit": gate}
    trial = {k: v.clone() for k, v in ref_all.items()}
    for row in (a, 300):  # ordinary a and its copy, the first selected row
        _swap_top2(trial["logits"][row])
        trial["gate_logit"][row] = -gate[row]
    y = torch.cat([ref.argmax(1), ref[order].argmax(1)])
    has_target = torch.tensor([i < 300 for i in range(320)])
    for margin, field in ((0.0, "flips"), (1e6, "near_boundary_flips")):
        cfg = dataclasses.replace(RULE, max_flips=1, max_near_boundary_flips=1, boundary_margin=margin, max_quality_drop=1.0,
                                  outputs={"*": Tolerance(atol=1e6, rtol=0.0)})
        stats, d = _judge(ids, y, has_target, ref_all, trial, cfg=cfg)
        for flips in (stats.flips, stats.heads["gate_logit"]):
            assert getattr(flips, field) == 1 and flips.real_flips == 1, flips
            assert flips.cases == 300 and flips.near_boundary_cases == (300 if margin else 0)
        assert d.decision == "accept", d.reasons
    # Per token: a sequence and its selected copy, the same position changed on both, in the slices compare reads.
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(12, 5, 7, generator=g)
    ids = [f"ordinary/{i}" for i in range(10)] + ["selected/3", "selected/8"]
    seq[10], seq[11] = seq[3], seq[8]
    tokens = seq.clone()
    for row in (3, 10):
        _swap_top2(tokens[row, 2])
    y = seq.argmax(-1)
    cfg = dataclasses.replace(RULE, max_flips=1, boundary_margin=0.0, max_quality_drop=1.0, outputs={"*": Tolerance(atol=1e6)})
    stats, d = _judge(ids, y, torch.tensor([i < 10 for i in range(12)]), {"logits": seq}, {"logits": tokens}, cfg=cfg)
    assert (stats.flips.flips, stats.flips.cases) == (1, 50) and d.decision == "accept", (stats.flips, d.reasons)


def test_a_measurement_head_beside_a_classifier_has_every_value_judged():
    """A head of a few columns that nothing names features ([N, 3] of about 300, 5 and 2: a size) is decided by default,
    but its values are a measurement: columns 1 and 2, more than 104 below column 0, are no class scores at softmax
    probability 0. The guide asks for explicit tolerances, scale by scale: destroyed, they roll the trial back (they
    were left out of every value statistic, and the trial accepted). A head named like scores keeps the rule of
    scores: a masked class (-1e9) rounded differently on both sides agrees."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    heads = torch.nn.Linear(32, 10), torch.nn.Linear(32, 3)
    x = torch.randn(400, 16)
    with torch.no_grad():
        h = body(x)
        r = heads[1](h)
        ref = {"logits": heads[0](h) * 5, "size": torch.stack([300 + 20 * r[:, 0], 5 + r[:, 1], 2 + 0.5 * r[:, 2]], 1)}
    y = ref["logits"].argmax(1)
    ids, has_target = [f"ordinary/{i}" for i in range(400)], torch.ones(400, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.01, rtol=0.01)})
    trial = {"logits": ref["logits"].clone(), "size": ref["size"] * torch.tensor([1.0, 10.0, 0.0])}
    stats, d = _judge(ids, y, has_target, ref, trial, cfg=cfg)
    assert "size" in stats.heads and stats.values["size"].failing == 800 and stats.values["size"].zero_probability_both == 0
    assert d.decision == "rollback" and any(r.startswith("values 'size': 800 of 1200") for r in d.reasons), d.reasons
    masked = {"logits": ref["logits"], "aux_logits": torch.cat([ref["logits"][:, :5], torch.full((400, 5), -1e9)], 1)}
    rounded = {k: v.clone() for k, v in masked.items()}
    rounded["aux_logits"][:, 5:] = -1.00001e9
    stats, d = _judge(ids, y, has_target, masked, rounded, cfg=cfg)
    assert stats.values["aux_logits"].zero_probability_both == 2000 and d.decision == "accept", d.reasons


def test_a_row_with_one_live_class_is_far_from_the_boundary_in_relative_margins():
    """``boundary_margin_kind: relative`` divides the top-2 gap by the spread of the row's live scores. A row whose every
    other class is at probability 0 (more than 104 below: a confident classifier at a large logit scale) has no second
    score to be near: its margin is infinite, and its changed decision a clear flip, limited by ``max_flips`` even where
    near-boundary flips are not limited (it was margin 0: near, and accepted)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5).eval()
    with torch.no_grad():
        model.weight.mul_(300)
    x = torch.randn(200, 8)
    ref = _fp32(model, x)
    s = ref["output"]
    top = s.topk(2).values
    a = int((top[:, 0] - top[:, 1]).argmax())
    assert float(top[a, 0] - top[a, 1]) > 104
    trial = {"output": s.clone()}
    _swap_top2(trial["output"][a])
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=1e6, rtol=0.0)}, boundary_margin_kind="relative",
                              max_near_boundary_flips=None, max_quality_drop=1.0)
    stats, d = _judge([f"ordinary/{i}" for i in range(200)], s.argmax(1), torch.ones(200, dtype=torch.bool), ref, trial, cfg=cfg)
    assert (stats.flips.flips, stats.flips.near_boundary_flips) == (1, 0)
    assert d.decision == "rollback" and any("1 flip(s) among real cases away from the boundary" in r for r in d.reasons)
    assert stats.flips.flip_list[0].reference_margin == math.inf


def test_top1_agreements_bound_is_taken_over_the_ordinary_tokens_not_their_selected_copies():
    """``min_top1_agreement``'s Clopper–Pearson bound, like the flip rate's: 40 ordinary sequences of 8 tokens and their
    40 selected copies agree everywhere; 320 independent tokens bound the agreement at 0.9907, not the 0.9953 that 640
    counted tokens would claim, so 0.993 is not shown (freeze says so too)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(40, 8, 16, generator=g)
    ids = [f"ordinary/{i}" for i in range(40)] + [f"selected/{i}" for i in range(40)]
    ref = torch.cat([scores, scores])
    y = ref.argmax(-1)
    has_target = torch.tensor([i < 40 for i in range(80)])
    cfg = dataclasses.replace(RULE, min_top1_agreement=0.993, max_quality_drop=1.0)
    stats, d = _judge(ids, y, has_target, {"logits": ref}, {"logits": ref.clone()}, cfg=cfg)
    assert stats.distribution.tokens == 320 and (stats.flips.sample, stats.flips.sample_flips) == (320, 0)
    assert d.decision == "rollback" and any("lower bound 0.990682 over 320 ordinary tokens" in r for r in d.reasons), d
    assert _judge(ids, y, has_target, {"logits": ref}, {"logits": ref.clone()},
                  cfg=dataclasses.replace(cfg, min_top1_agreement=0.99))[1].decision == "accept"


def test_kl_is_measured_on_the_ordinary_tokens_and_edge_cases_that_agree_do_not_dilute_it():
    """KL mean and p99 describe the application's tokens: 20 ordinary sequences whose trial moves every distribution,
    beside 200 edge sequences on which it agrees exactly, must not pass a KL limit the ordinary tokens exceed (over
    all 1,100 tokens the mean is 11 times smaller, and the p99 is the ordinary tokens' 12th largest)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(220, 5, 16, generator=g) * 2
    trial = ref.clone()
    trial[:20] += torch.randn(20, 5, 16, generator=g) * 0.3
    ids = [f"ordinary/{i}" for i in range(20)] + [f"edge/user/{i}" for i in range(200)]
    y = ref.argmax(-1)
    has_target = torch.tensor([i < 20 for i in range(220)])
    stats, _ = _judge(ids, y, has_target, {"logits": ref}, {"logits": trial})
    dist = stats.distribution
    assert dist.tokens == 100
    d32 = ref[:20].double()
    truth = (torch.softmax(d32, -1) * (torch.log_softmax(d32, -1) - torch.log_softmax(trial[:20].double(), -1))).sum(-1)
    assert math.isclose(dist.kl_mean, float(truth.mean()), rel_tol=1e-5)
    assert math.isclose(dist.kl_p99, float(truth.flatten().sort().values[98]), rel_tol=1e-5)
    cfg = dataclasses.replace(RULE, max_kl_mean=dist.kl_mean / 2, max_near_boundary_flips=None, max_flips=100,
                              max_quality_drop=1.0, outputs={"*": Tolerance(atol=10.0, rtol=1.0)})
    d = rule.decide(stats, cfg)
    assert d.decision == "rollback" and any("KL(reference || trial) mean" in r for r in d.reasons), d.reasons


def test_flip_rate_bound_needs_enough_cases_and_does_not_roll_back_a_large_set_on_noise():
    cfg = dataclasses.replace(RULE, max_flip_rate=0.01, confidence=0.95)
    assert bounds.cases_needed(0.01, 0.95) == 299
    n, k = 100, 0
    assert bounds.binomial_upper(k, n, 0.95) > 0.01  # 100 cases cannot give a confident accept, even with no flip
    flips = Decisions(cases=n, boundary_cases=0, near_boundary_cases=0, flips=0, near_boundary_flips=0, boundary_flips=0,
                      unit="case", boundary_flip_fraction=0.0, real_flips=0, flip_list=(), flip_list_dropped=0, sample=n,
                      sample_flips=0)
    j = rule._Judge()
    rule._decisions(flips, cfg, j, "decisions", "flips")
    assert j.failed["inference"] and "needs at least 299" in j.reasons[0]
    listed = tuple(Flip(id=f"ordinary/{i}", kind="ordinary", boundary=False, near_boundary=False) for i in range(250))
    big = dataclasses.replace(flips, cases=50_000, flips=250, real_flips=250, flip_list=listed, sample=50_000, sample_flips=250)
    j = rule._Judge()
    rule._decisions(big, cfg, j, "decisions", "flips")  # 0.5 % observed, upper bound 0.56 % < 1 %
    assert not j.failed["inference"], j.reasons
    # Known at freeze: a rule that no trial of this set can pass is refused there, not learnt from a rolled-back trial.
    steps, shapes = [step(0, 1.0)], {"logits": (3,)}

    def vetted(cfg, real, shapes=shapes, kind="classification"):
        return _vet(cfg, kind, shapes, {n: 3.0 for n in shapes}, 0.9, "accuracy", True, steps, real_units=real)

    line = vetted(cfg, 256)
    assert "needs at least 299 ordinary cases" in line and "has 256" in line and "at least 0.0116" in line, line
    assert vetted(cfg, 299) is None and vetted(dataclasses.replace(cfg, max_flip_rate=0.0117), 256) is None
    assert "upper bound is above 0 on any set" in vetted(dataclasses.replace(cfg, max_flip_rate=0.0), 10**9)
    assert "needs at least 299 ordinary positions" in vetted(cfg, 100, shapes={"logits": (8, 3)})
    # Every decided output is judged against the rate on its own: a regression's decisions, and a per-case head beside
    # per-token scores, are counted in cases (freeze accepted both, and every trial then rolled back).
    assert "needs at least 299 ordinary cases" in vetted(cfg, 200, shapes={"output": (1,), "logits": (3,)}, kind="regression")
    assert "needs at least 299 ordinary cases" in vetted(cfg, 200, shapes={"logits": (8, 16), "cls_logits": (3,)})
    from pipeline import cases, config
    from pipeline.vetting import Scan

    n_cases, length = 200, 8
    tokens = torch.randint(0, 16, (n_cases, length))
    scan = Scan(dataclasses.replace(config.Params(), task=TaskConfig(kind="classification"), acceptance=cfg),
                cases.Cases(ids=[f"ordinary/s{i}" for i in range(n_cases)], x=tokens, y=tokens,
                            has_target=torch.ones(n_cases, dtype=torch.bool)))
    scan.update(0, {"logits": torch.randn(n_cases, length, 16), "cls_logits": torch.randn(n_cases, 3)})
    assert (scan.real_units(), scan.tokens()) == (n_cases, n_cases * length)  # the per-case head's count, the fewest
    # So is top-1 agreement's lower bound: 600 tokens cannot show 0.999 at 0.95, even when every one agrees.
    agreement = dataclasses.replace(RULE, min_top1_agreement=0.999)
    line = _vet(agreement, "classification", {"logits": (6, 10)}, {"logits": 3.0}, 0.9, "accuracy", True, steps,
                         real_units=600, tokens=600)
    assert "min_top1_agreement 0.999" in line and "600 ordinary tokens" in line and "at most 0.995" in line, line
    assert _vet(agreement, "classification", {"logits": (6, 10)}, {"logits": 3.0}, 0.9, "accuracy", True, steps,
                         real_units=3000, tokens=3000) is None
    # KL and top-1 agreement judge per-token scores: on a per-case classifier or a regression they could never pass.
    for said in ({"max_kl_mean": 0.01}, {"max_kl_p99": 0.05}, {"min_top1_agreement": 0.99}):
        line = vetted(dataclasses.replace(RULE, **said), 256)
        assert f"acceptance.{next(iter(said))} judges per-token scores" in line and "'logits' is [N, 3]" in line, line
        assert "regression's output 'output'" in vetted(dataclasses.replace(RULE, **said), 256, {"output": (1,)}, "regression")
        assert vetted(dataclasses.replace(RULE, **said), 256, {"logits": (8, 3)}) is None
    # Exactness: the bound is the Clopper–Pearson one (checked against the beta quantile, scipy's).
    scipy_stats = pytest.importorskip("scipy.stats")
    assert bounds.binomial_upper(250, 50_000, 0.95) == pytest.approx(scipy_stats.beta.ppf(0.95, 251, 50_000 - 250), rel=1e-9)


def test_a_second_classification_head_is_decided_too():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.body = torch.nn.Linear(16, 32)
            self.main = torch.nn.Linear(32, 3)
            self.aux = torch.nn.Linear(32, 5)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                self.main.weight.mul_(3.0)
                # A low-margin second head (one common row plus small differences): bf16 flips it.
                self.aux.weight.copy_(torch.randn(1, 32, generator=g) + 0.002 * torch.randn(5, 32, generator=g))
                self.aux.bias.zero_()

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"logits": self.main(h), "aux": self.aux(h)}

    model = TwoHeads()
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(2))
    ids = [f"ordinary/s{i}" for i in range(300)]
    ref = _fp32(model, x)
    y = ref["logits"].argmax(1)
    trial = _autocast(model, x, torch.bfloat16)
    assert bool((trial["logits"].argmax(1) == y).all()) and int((trial["aux"].argmax(1) != ref["aux"].argmax(1)).sum()) > 5
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.5, rtol=0.02)}, max_near_boundary_flips=None)
    stats, d = _judge(
        ids, y, torch.ones(300, dtype=torch.bool), ref, trial, cfg=dataclasses.replace(cfg, max_near_boundary_flips=0)
    )
    assert "aux" in stats.heads and d.decision == "rollback"
    assert any(r.startswith("decisions 'aux'") for r in d.reasons) and d.cases["flips aux"]
    # Saying in the rule that aux is not a decision (an embedding, say) is explicit, hashed, and listed as loosened.
    values_only = dataclasses.replace(
        cfg, outputs={"*": Tolerance(atol=0.5, rtol=0.02), "aux": Tolerance(atol=0.5, rtol=0.02, decisions=False)}
    )
    stats, d = _judge(ids, y, torch.ones(300, dtype=torch.bool), ref, trial, cfg=values_only)
    assert "aux" not in stats.heads and d.decision == "accept", d.reasons
    assert "outputs.aux.decisions None -> false" in rule.loosened(cfg, values_only)


def test_which_heads_are_decided_by_default():
    """Every output shaped like class scores or one logit is decided (an untested head is no accept), except those
    whose name says features (hidden states, an embedding: their argmax means nothing, a flip there is no changed
    decision); the rule's ``decisions`` says otherwise either way. The primary is always decided."""
    shapes = {"logits": (3,), "aux": (5,), "tags": (6, 4), "flag": (1,), "box": (4,), "embedding": (64,),
              "last_hidden_state": (6, 32), "pooler_output": (32,), "sentence_embeddings": (16,)}
    shapes = {k: (10, *v) for k, v in shapes.items()}
    plain = AcceptanceConfig()
    assert heads.decided_heads("classification", plain, shapes, "logits") == ["aux", "box", "logits", "tags"]
    assert heads.sign_heads("classification", plain, shapes, "logits") == ["flag"]
    said = AcceptanceConfig(outputs={"*": Tolerance(), "embedding": Tolerance(decisions=True),
                                     "aux": Tolerance(decisions=False), "flag": Tolerance(decisions=False)})
    assert heads.decided_heads("classification", said, shapes, "logits") == ["box", "embedding", "logits", "tags"]
    assert heads.sign_heads("classification", said, shapes, "logits") == []
    assert heads.decided_heads("classification", plain, {"hidden": (10, 3)}, "hidden") == ["hidden"]  # the primary
    # A name that ends like scores is decided whatever else it says.
    scores = {"logits": (10, 3), "dialog_state_logits": (10, 4), "attention_scores": (10, 4), "latent_class_probs": (10, 2)}
    assert heads.decided_heads("classification", plain, scores, "logits") == sorted(scores)
    # Taking decisions: true back on a feature name stops deciding it: a loosening, listed like decisions: false.
    on = AcceptanceConfig(outputs={"*": Tolerance(), "hidden": Tolerance(decisions=True)})
    assert rule.loosened(on, AcceptanceConfig(outputs={"*": Tolerance(), "hidden": Tolerance()})) == [
        "outputs.hidden.decisions True -> null"]
    assert rule.loosened(on, AcceptanceConfig()) == ["outputs.hidden.decisions True -> null"]  # the entry removed
    assert rule.loosened(AcceptanceConfig(), on) == []
    assert heads.decided_heads("regression", plain, shapes, "logits") == []  # a regression's primary: its threshold
    assert heads.sign_heads("regression", plain, shapes, "logits") == []
    # A regression's other heads named like scores are decided too (an untested head is no accept); others only if said.
    regression = {"output": (10, 1), "logits": (10, 4), "alarm_logit": (10, 1), "aux": (10, 3), "tags": (10, 6, 4)}
    assert heads.decided_heads("regression", plain, regression, "output") == ["logits"]
    assert heads.sign_heads("regression", plain, regression, "output") == ["alarm_logit"]
    aux = AcceptanceConfig(outputs={"*": Tolerance(), "aux": Tolerance(decisions=True)})
    assert heads.decided_heads("regression", aux, regression, "output") == ["aux", "logits"]
    # Class probabilities by their common names (scikit-learn's predict_proba, a class_prob head) are class scores.
    named = {"output": (10, 1), "proba": (10, 3), "class_prob": (10, 3), "class_probability": (10, 2), "cls_class": (10, 4)}
    assert heads.decided_heads("regression", plain, named, "output") == ["class_prob", "class_probability", "cls_class",
                                                                           "proba"]


def test_a_regressions_output_of_probability_rows_must_say_whether_it_is_decided():
    """A regression with a second head of softmax rows that its name does not call class scores ('mix'): class
    probabilities would go undecided, where a shift of 0.03 within atol flips the class of 43 of 300 cases (« Une
    différence faible en valeur absolue peut changer l'action choisie »); proportions would be values. freeze asks,
    in one line naming both fixes; either answer passes, and so does an output whose rows are not distributions."""
    from pipeline import cases, vetting
    from pipeline.config import Params

    g = torch.Generator().manual_seed(0)
    n = 300
    head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(dim=-1))
    x = torch.randn(n, 4, generator=g)
    with torch.no_grad():
        for p in head.parameters():  # seeded here: the same head whatever ran before in this process
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        value, mix = x[:, :1] * 3, head(x)
    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=x, y=value + 0.1 * torch.randn(n, 1, generator=g),
                        has_target=torch.ones(n, dtype=torch.bool))

    def vetted(outputs, mix=mix):
        params = Params(task=TaskConfig(kind="regression", loss="mse"), acceptance=dataclasses.replace(RULE, outputs=outputs))
        scan = vetting.Scan(params, fixed)
        scan.update(0, {"output": value[:100], "mix": mix[:100]})
        scan.update(100, {"output": value[100:], "mix": mix[100:]})
        return scan.problem([step(0, 1.0)])

    line = vetted({"*": Tolerance()})
    assert "output 'mix' of the regression holds" in line and "{decisions: true}" in line and "{decisions: false}" in line
    assert "\n" not in line
    assert vetted({"*": Tolerance(), "mix": Tolerance(decisions=True)}) is None
    # Proportions are values, judged like any: the question is answered, and a tolerance below their spread passes (the
    # default atol 0.05 is refused where a column of this random head varies by less than that).
    answered = vetted({"*": Tolerance(), "mix": Tolerance(decisions=False)})
    assert answered is None or "is not below the spread of column" in answered, answered
    assert vetted({"*": Tolerance(), "mix": Tolerance(atol=0.001, rtol=0.0, decisions=False)}) is None
    assert vetted({"*": Tolerance()}, mix=mix * 2) is None  # rows summing to 2: no distribution
    # Said decided, the shift within atol that flips classes rolls back.
    shifted = mix + torch.tensor([0.03, -0.03, 0.0])
    ids = fixed.ids
    said = dataclasses.replace(RULE, outputs={"*": Tolerance(), "mix": Tolerance(decisions=True)})
    _, d = _judge(ids, fixed.y, fixed.has_target, {"output": value, "mix": mix}, {"output": value, "mix": shifted}, cfg=said)
    assert d.decision == "rollback" and any("decisions 'mix'" in r for r in d.reasons), d.reasons


def test_a_head_named_like_scores_that_no_decision_check_reads_is_refused_at_freeze():
    """Segmentation-like heads [N, C, H, W] (4 dims): argmax over classes-last and the sign of one logit read [N, C],
    [N, T, C] and [N], [N, 1], [N, T, 1] only. A 4-dim output named like scores, or said ``decisions: true``, would
    go untested: freeze refuses it in one line naming the output and the two fixes; ``decisions: false`` (values
    only) passes, and so does a 4-dim output that does not say scores (a mask of values)."""
    steps = [step(i, 1.0) for i in range(4)]
    shapes = {"logits": (3,), "seg_logits": (4, 8, 8), "pred_masks": (1, 8, 8)}
    rms = {name: 1.0 for name in shapes}
    line = _vet(AcceptanceConfig(), "classification", shapes, rms, 0.9, "accuracy", True, steps)
    assert "output 'seg_logits' of shape [N, 4, 8, 8] is named like scores" in line and "decisions: false" in line
    assert "[N, T, classes]" in line
    values = AcceptanceConfig(outputs={"*": Tolerance(), "seg_logits": Tolerance(decisions=False)})
    assert _vet(values, "classification", shapes, rms, 0.9, "accuracy", True, steps) is None
    said = AcceptanceConfig(outputs={"*": Tolerance(), "seg_logits": Tolerance(decisions=False),
                                     "pred_masks": Tolerance(decisions=True)})
    assert "output 'pred_masks'" in _vet(said, "regression", shapes, rms, -0.1, "neg_rmse", True, steps)


def test_a_fixed_set_without_targets_is_refused_at_freeze_under_a_quality_criterion():
    """No case carries a target: a rule that sets a quality criterion could never accept (every trial, even one
    identical to the reference, would roll back on quality), so freeze refuses it before any trial is trained; the
    same rule without quality criteria passes."""
    steps = [step(i, 1.0) for i in range(4)]
    shapes, rms = {"logits": (3,)}, {"logits": 1.0}
    line = _vet(AcceptanceConfig(), "classification", shapes, rms, math.nan, "accuracy", True, steps)
    assert line.startswith("the FP32 reference has no quality to judge trials by: no case of the fixed set carries")
    assert "max_quality_drop: null and min_quality: null" in line
    without = AcceptanceConfig(max_quality_drop=None, min_quality=None)
    assert _vet(without, "classification", shapes, rms, math.nan, "accuracy", True, steps) is None


def test_columns_of_different_scales_need_an_atol_below_the_smallest():
    """A regression [N, 2] whose columns are about 1000 and 1e-3: atol 0.05 is far below the output's RMS (~1000),
    and yet above the small column's whole size, so a trial that negates that column would pass. freeze refuses,
    naming the column and a fix; an atol below it, with rtol bounding the large column, is accepted and then
    catches the negated column."""
    from pipeline import cases, config
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(6)
    n = 200
    ref = torch.stack([1000 + 10 * torch.randn(n, generator=g), 1e-3 * torch.randn(n, generator=g)], 1)
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression"))
    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=torch.zeros(n, 1), y=ref.clone(),
                        has_target=torch.ones(n, dtype=torch.bool))
    scan = Scan(dataclasses.replace(params, acceptance=AcceptanceConfig(max_quality_drop=None)), fixed)
    scan.update(0, {"output": ref[:150]})
    scan.update(150, {"output": ref[150:]})
    columns = scan.column_rms()["output"]
    assert columns == pytest.approx(tuple(ref.double().square().mean(0).sqrt().tolist()), rel=1e-12)
    assert scan.rms()["output"] > 700 and columns[1] < 0.002
    # A column of zeros has no scale: the smallest column with one is still the one the atol must be below.
    assert "column 1 of output" in _vet(scan.rule, "regression", {"output": (3,)}, scan.rms(), -1.0, "neg_rmse",
                                                 True, [_step(0, loss=10.0, grad_norm=1.0)],
                                                 columns={"output": (*columns, 0.0)[::-1]})
    steps = [_step(0, loss=10.0, grad_norm=1.0)]
    loose = AcceptanceConfig(max_quality_drop=None, min_quality=None, loss_noise_multiple=None)  # atol 0.05, rtol 0.02
    line = scan.problem(steps)
    assert "atol 0.05 is not below the scale of column 1 of output 'output'" in line and "rtol" in line, line
    assert "\n" not in line
    fitted = dataclasses.replace(loose, outputs={"*": Tolerance(atol=1e-5, rtol=0.02)})
    assert _vet(fitted, "regression", {"output": (2,)}, scan.rms(), -1.0, "neg_rmse", True, steps,
                         columns={"output": columns}) is None
    trial = ref.clone()
    trial[:, 1] *= -10.0
    ids = [f"ordinary/{i}" for i in range(n)]
    every = torch.ones(n, dtype=torch.bool)
    assert _judge(ids, ref, every, {"output": ref}, {"output": trial}, cfg=loose)[1].decision == "accept"
    _, d = _judge(ids, ref, every, {"output": ref}, {"output": trial}, cfg=fitted)
    assert d.decision == "rollback" and any(r.startswith("values 'output'") for r in d.reasons), d.reasons
    # The same columns per token ([N, T, 2]) and as a classifier's values-only output: vetted column by column too.
    per_token = torch.stack([ref, ref.roll(1, 0), ref.roll(2, 0)], 1)
    scan = Scan(dataclasses.replace(params, acceptance=loose), fixed)
    scan.update(0, {"output": per_token})
    assert "column 1 of output 'output'" in scan.problem(steps)
    said = dataclasses.replace(loose, outputs={"*": Tolerance(), "extra": Tolerance(decisions=False)})
    classifier = dataclasses.replace(params, task=TaskConfig(), acceptance=said)
    scan = Scan(classifier, cases.Cases(ids=ids, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.long), has_target=every))
    scan.update(0, {"logits": 4.0 * torch.randn(n, 3, generator=g), "extra": ref})
    assert set(scan.column_rms()) == {"extra"} and "column 1 of output 'extra'" in scan.problem(steps)
    # A regression's primary is values whatever its name (a Hugging Face regression head returns logits).
    scan = Scan(dataclasses.replace(params, acceptance=loose), fixed)
    scan.update(0, {"logits": ref})
    assert "column 1 of output 'logits'" in scan.problem(steps)
    # An embedding said decisions: false is values, but its dimensions are no quantities of their own.
    said = dataclasses.replace(loose, outputs={"*": Tolerance(), "embedding": Tolerance(decisions=False)})
    scan = Scan(dataclasses.replace(classifier, acceptance=said),
                cases.Cases(ids=ids, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.long), has_target=every))
    scan.update(0, {"logits": 4.0 * torch.randn(n, 3, generator=g), "embedding": ref})
    assert scan.column_rms() == {} and scan.problem(steps) is None


def test_a_destroyed_small_column_of_the_amp_trained_regression_rolls_back():
    """A real two-column regression head (columns about 1000 and 1e-3) trained in FP32, and an AMP-trained model whose
    small column never learned (the head's row for it left at its initial weights, as when float16 gradients of a
    1e-3 target underflow): its error there grows ~100x, yet the RMSE pooled over both columns is the large column's and
    moves less than the rule's drop. Quality is judged per column too (the drop the rule allows the output, as a share
    of the reference's error, on each column's own error): rolled back, naming the column. A healthy retraining whose
    columns both move a little is accepted."""
    g = torch.Generator().manual_seed(11)
    n = 300
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 2, generator=g) * torch.tensor([30.0, 1e-3])
    y = x @ w + torch.tensor([1000.0, 0.0]) + torch.randn(n, 2, generator=g) * torch.tensor([1.0, 1e-5])
    initial = torch.nn.Linear(8, 2)
    with torch.no_grad():
        initial.weight.copy_(0.1 * torch.randn(2, 8, generator=g))
        initial.bias.zero_()
    trained = torch.nn.Linear(8, 2)
    with torch.no_grad():  # the least-squares fit: what FP32 training converges to
        solution = torch.linalg.lstsq(torch.cat([x, torch.ones(n, 1)], 1).double(), y.double()).solution.float()
        trained.weight.copy_(solution[:8].T)
        trained.bias.copy_(solution[8])
    stuck = torch.nn.Linear(8, 2)
    stuck.load_state_dict(trained.state_dict())
    with torch.no_grad():
        stuck.weight[1].copy_(initial.weight[1])
        stuck.bias[1].copy_(initial.bias[1])
    ref = _fp32(trained, x)
    trial = _autocast(trained, x, torch.float16)
    ids = [f"ordinary/{i}" for i in range(n)]
    every = torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=1e-5, rtol=0.02)}, max_quality_drop=0.2)
    stats, d = _judge(ids, y, every, ref, ref, _fp32(stuck, x), cfg=cfg)
    pooled = stats.quality.reference - stats.quality.trained
    assert 0 <= pooled < 0.2, stats.quality  # the pooled RMSE alone would accept
    assert stats.quality.columns["trained"][1] < 50 * stats.quality.columns["reference"][1]
    assert d.decision == "rollback" and d.training == "rollback", d.reasons
    assert any(r.startswith("quality after training, per column") and "column 1:" in r and "column 0:" not in r
               for r in d.reasons), d.reasons
    # A healthy retraining: each column a little off the fit, within the rule's share of its own error.
    healthy = torch.nn.Linear(8, 2)
    healthy.load_state_dict(trained.state_dict())
    with torch.no_grad():
        healthy.bias.add_(torch.tensor([0.05, 1e-7]))
    stats, d = _judge(ids, y, every, ref, trial, _fp32(healthy, x), cfg=cfg)
    assert stats.quality.columns is not None and d.decision == "accept", d.reasons
    assert any(c.startswith("quality after training, per column: each of 2 columns") for c in d.checks), d.checks


def test_boundary_cases_selected_from_an_lm_keep_their_ignored_positions():
    """Token inputs: boundary cases are real samples selected by their smallest reference margin (``selected/``). They
    are copies of ordinary samples, so the positions the sample's targets ignore (-100: padding) stay ignored, and the
    margin they are picked by is taken over the kept positions only. A real tiny LM whose padded positions are near
    ties: under real bf16 autocast its decisions flip only at padding, so the verdict is the ordinary cases' (accept);
    copies judged at their padding rolled it back."""
    from pipeline import cases
    from pipeline.task import IGNORE_INDEX

    g = torch.Generator().manual_seed(7)
    vocab, length, n = 8, 16, 200

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, vocab, padding_idx=0)  # padding: a zero vector, every score a tie
            self.head = torch.nn.Linear(vocab, vocab)
            with torch.no_grad():
                self.emb.weight.copy_(2.0 * torch.eye(vocab) + 0.05 * torch.randn(vocab, vocab, generator=g))
                self.emb.weight[0].zero_()
                self.head.weight.copy_(5.0 * torch.eye(vocab))
                self.head.bias.fill_(5.0)
            self.register_buffer("noise", 0.003 * torch.randn(1, length, vocab, generator=g))

        def forward(self, ids):
            e = self.emb(ids)
            return self.head(torch.tanh(e + 0.01 * e.cumsum(1) + self.noise[:, : ids.shape[1]]))

    model = TinyLM()
    lengths = torch.randint(6, length + 1, (n,), generator=g)
    position = torch.arange(length)[None, :]
    tokens = torch.randint(1, vocab, (n, length), generator=g)
    tokens = torch.where(position < lengths[:, None], tokens, torch.zeros_like(tokens))
    targets = torch.where(position < lengths[:, None] - 1, tokens.roll(-1, 1), torch.full_like(tokens, IGNORE_INDEX))
    ordinary = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=tokens, y=targets,
                           has_target=torch.ones(n, dtype=torch.bool))
    selected = cases.boundary_cases(lambda x: _fp32(model, x)["output"], ordinary, 8, 1e-3, targets, method="auto")
    source = torch.tensor([int(i.split("/")[1]) for i in selected.ids])
    assert selected.ids[0].startswith("selected/") and torch.equal(selected.y, targets[source])
    assert not bool(selected.has_target.any())  # quality counts each sample once
    kept = targets != IGNORE_INDEX
    per_case = cases.margins(_fp32(model, tokens)["output"], kept)
    assert sorted(source.tolist()) == sorted(sorted(range(n), key=lambda i: (float(per_case[i]), i))[:8])
    fixed = ordinary + selected
    ref, trial = _fp32(model, fixed.x), _autocast(model, fixed.x, torch.bfloat16)
    flips = ref["output"].argmax(-1) != trial["output"].argmax(-1)
    assert bool((flips & (fixed.y == IGNORE_INDEX)).any()) and not bool((flips & (fixed.y != IGNORE_INDEX)).any())
    _, d = _judge(fixed.ids, fixed.y, fixed.has_target, ref, trial)
    assert d.decision == "accept", d.reasons


def test_a_tolerance_wider_than_an_offset_outputs_spread_is_refused_at_freeze():
    """A regression head with a large offset (pressure, ~101340 Pa, standard deviation ~60 Pa): rtol 0.02 of |ref| is
    ~2000 Pa, wider than the whole variation of the output, and its RMS (~1e5, the offset's) lets any atol through.
    Under real bf16 autocast every pressure comes out as one value, and so would a trial answering the mean: both
    pass the values check. freeze refuses the rule, naming the output, its spread and a fix; with that fix, the bf16
    trial rolls back."""
    from pipeline import cases, config
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(0)

    class Weather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.temp, self.pressure = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                self.pressure.weight.mul_(20.0)
                self.pressure.bias.fill_(101325.0)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"output": self.temp(h), "pressure": self.pressure(h)}

    model, n = Weather(), 300
    x = torch.randn(n, 8, generator=g)
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    ref, trial = _fp32(model, x), _autocast(model, x, torch.bfloat16)
    y = ref["output"] + 0.05 * torch.randn(n, 1, generator=g)
    assert trial["pressure"].unique().numel() == 1  # bf16 keeps 8 bits: one value for the whole spread
    shipped = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)}, max_quality_drop=0.005)
    assert _judge(ids, y, every, ref, trial, cfg=shipped)[1].decision == "accept"  # what freeze must not let run
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression"), acceptance=shipped)
    scan = Scan(params, cases.Cases(ids=ids, x=x, y=y, has_target=every))
    scan.update(0, ref)
    line = scan.problem([_step(0, loss=10.0, grad_norm=1.0)])
    assert line.startswith("params.yaml: acceptance.outputs.*: atol 0.05 + rtol 0.02 x |mean|") and "'pressure'" in line, line
    assert "standard deviation" in line and "rtol: 0}" in line and "\n" not in line
    fitted = dataclasses.replace(shipped, outputs={"*": Tolerance(atol=0.05, rtol=0.02),
                                                   "pressure": Tolerance(atol=0.6, rtol=0.0)})
    scan = Scan(dataclasses.replace(params, acceptance=fitted), cases.Cases(ids=ids, x=x, y=y, has_target=every))
    scan.update(0, ref)
    assert scan.problem([_step(0, loss=10.0, grad_norm=1.0)]) is None
    _, d = _judge(ids, y, every, ref, trial, cfg=fitted)
    assert d.decision == "rollback" and any(r.startswith("values 'pressure'") for r in d.reasons), d.reasons


def test_an_integer_head_whose_tolerance_reaches_one_unit_is_refused_at_freeze():
    """An ordinal model returns its decision as an index (``age_bin``, the argmax over 100 bins, int64, 53..99): under
    real bf16 autocast 1 bin in 4 moves by one, and rtol 0.02 x 99 is about 2 bins, so every change passes the values
    check (and no sign of a non-negative index ever flips). A whole-number output's unit is 1: freeze refuses a band
    that reaches it, naming the output and a fix; with that fix the bf16 trial rolls back naming the cases."""
    from pipeline import cases, config
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(4)

    class AgeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.main, self.age = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3), torch.nn.Linear(32, 1)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                self.main.weight.mul_(10.0)
                self.age.weight.mul_(2.0)
                self.age.bias.fill_(75.0)
            self.register_buffer("bins", torch.arange(100.0))

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"logits": self.main(h), "age_bin": (-(self.bins - self.age(h)) ** 2 / 8.0).argmax(-1)}

    model, n = AgeModel(), 400
    x = torch.randn(n, 16, generator=g)
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    ref, trial = _fp32(model, x), _autocast(model, x, torch.bfloat16)
    ref["age_bin"] = ref["age_bin"].float()  # as inference records every output
    y = ref["logits"].argmax(1)
    moved = int((ref["age_bin"] != trial["age_bin"]).sum())
    assert moved > 20 and float((ref["age_bin"] - trial["age_bin"]).abs().max()) == 1.0
    shipped = dataclasses.replace(RULE, outputs={"*": Tolerance(), "logits": Tolerance(atol=1.0, rtol=0.02)})
    assert _judge(ids, y, every, ref, trial, cfg=shipped)[1].decision == "accept"  # what freeze must not let run

    def vetted(rule):
        scan = Scan(dataclasses.replace(config.Params(), acceptance=rule), cases.Cases(ids=ids, x=x, y=y, has_target=every))
        scan.update(0, ref)
        return scan.problem([_step(0, loss=10.0, grad_norm=1.0)])

    line = vetted(shipped)
    assert line.startswith("params.yaml: acceptance.outputs.*: atol 0.05 + rtol 0.02 x 99 reaches 1 on output 'age_bin'"), line
    assert "{atol: 0.5, rtol: 0}" in line
    fitted = dataclasses.replace(shipped, outputs={**shipped.outputs, "age_bin": Tolerance(atol=0.5, rtol=0.0)})
    assert vetted(fitted) is None
    _, d = _judge(ids, y, every, ref, trial, cfg=fitted)
    assert d.decision == "rollback" and any(r.startswith("values 'age_bin'") for r in d.reasons), d.reasons


def test_skips_bunched_at_the_end_are_a_falling_scale_not_a_designed_skip():
    """200 updates, 16 of the last 18 skipped (the scale halving each time): 8 % of the run, within
    max_skipped_fraction 0.1, and never 10 skips in a row, yet the updates have nearly stopped (the guide: « les mises
    à jour cessent d'avancer »). The last stall_window steps allow one skip (the scaler's design: it grows the scale,
    then backs off once), so early scale search and a back-off now and then still pass."""
    ref_steps = tuple(step(i, 2.0 / (1 + i / 20)) for i in range(200))
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(0)) * 3
    ids = [f"ordinary/{i}" for i in range(20)]
    rule_ = dataclasses.replace(RULE, loss_noise_multiple=None)

    def judged(skips):
        trial = tuple(step(i, s.loss, scale=2.0 ** (16 - sum(k < i for k in skips)), skipped=i in skips)
                      for i, s in enumerate(ref_steps))
        aligned = tuple(step(i, s.loss, skipped=i in skips) for i, s in enumerate(ref_steps))
        return _judge(ids, x.argmax(1), torch.ones(20, dtype=torch.bool), {"output": x}, {"output": x.clone()}, cfg=rule_,
                      steps=ref_steps, trial_steps=trial, aligned=aligned, scaler=True)

    stats, d = judged(set(range(182, 190)) | set(range(191, 199)))
    assert stats.training.skipped_fraction < 0.1 and not stats.training.stalled
    assert stats.training.recent_skipped_steps == 8 and d.training == "rollback"  # steps 191-198
    assert any("8 of the last 10 updates skipped > allowed 1" in r for r in d.reasons), d.reasons
    for healthy in ({3, 150, 195}, {0, 1, 2, 199}):
        stats, d = judged(healthy)
        assert d.training == "accept", (healthy, d.reasons)


def test_a_single_logit_head_is_decided_by_its_sign():
    """A sigmoid head ([N, 1] or [N]: class 1 where the logit is >= 0) beside the class scores: bf16 moves its
    near-zero logits across 0 by less than the value tolerance. Its decisions changed, so the verdict rolls back
    (an argmax over one column never changes); saying ``decisions: false`` (a value, not a decision) accepts."""

    class WithFlag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(4)
            self.body, self.main, self.flag = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3), torch.nn.Linear(32, 1)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                self.main.weight.mul_(3.0)
                self.flag.weight.mul_(0.01)  # logits of a few hundredths: bf16's rounding crosses 0 on some
                self.flag.bias.zero_()

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"logits": self.main(h), "flag": self.flag(h)}

    model = WithFlag()
    x = torch.randn(400, 16, generator=torch.Generator().manual_seed(5))
    ids = [f"ordinary/s{i}" for i in range(400)]
    ref, trial = _fp32(model, x), _autocast(model, x, torch.bfloat16)
    trial["logits"] = ref["logits"].clone()  # the class scores held as they were: the verdict is the flag's alone
    y = ref["logits"].argmax(1)
    crossed = int(((ref["flag"] >= 0) != (trial["flag"] >= 0)).sum())
    assert crossed > 0
    assert float((trial["flag"] - ref["flag"]).abs().max()) < 0.5
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.5, rtol=0.02)})
    for shaped in (lambda v: v, lambda v: v[:, 0]):  # [N, 1] and [N]
        r, t = ({**o, "flag": shaped(o["flag"])} for o in (ref, trial))
        stats, d = _judge(ids, y, torch.ones(400, dtype=torch.bool), r, t, cfg=cfg)
        assert stats.heads["flag"].real_flips == crossed and d.decision == "rollback", d.reasons
        assert any(reason.startswith("decisions 'flag'") for reason in d.reasons) and d.cases["flips flag"]
    # The same head as its sigmoid's probability: decided at 0.5, not by sign (every probability is >= 0, so no sign
    # ever flips): by its name, or, under a name that says neither, because every reference value lies in [0, 1].
    for name in ("fraud_prob", "flag"):
        r, t = ({"logits": o["logits"], name: torch.sigmoid(o["flag"])} for o in (ref, trial))
        stats, d = _judge(ids, y, torch.ones(400, dtype=torch.bool), r, t, cfg=cfg)
        assert stats.heads[name].real_flips == crossed and d.decision == "rollback", (name, d.reasons)
        assert stats.heads[name].flip_list[0].reference in [float(v) for v in r[name][:, 0]]  # the probability itself
    values_only = dataclasses.replace(cfg, outputs={**cfg.outputs, "flag": Tolerance(atol=0.5, rtol=0.02, decisions=False)})
    stats, d = _judge(ids, y, torch.ones(400, dtype=torch.bool), ref, trial, cfg=values_only)
    assert "flag" not in stats.heads and d.decision == "accept", d.reasons


def test_non_finite_outputs_of_the_amp_trained_model_roll_back_with_their_ids():
    """The AMP-trained model overflows float16 on the edge cases (scaled x1000) only: its ordinary quality is intact."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    x = torch.cat([torch.rand(40, 8, generator=g), torch.rand(11, 8, generator=g) * 1000.0])
    ids = [f"ordinary/s{i}" for i in range(40)] + [f"edge/s{i}x1000" for i in range(11)]
    has_target = torch.tensor([True] * 40 + [False] * 11)
    ref = _fp32(model, x)
    y = ref["output"].argmax(1)
    trained_model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    trained_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        # What AMP training drifted to (a power of two: the same numbers on ordinary inputs), past 65504 at x1000.
        trained_model[0].weight.mul_(1024.0)
        trained_model[0].bias.mul_(1024.0)
        trained_model[2].weight.div_(1024.0)
    trained = _autocast(trained_model, x, torch.float16)
    bad = ~torch.isfinite(trained["output"]).all(1)
    assert int(bad[40:].sum()) == 11 and int(bad[:40].sum()) == 0 and bool((trained["output"][:40].argmax(1) == y[:40]).all())
    trial = _autocast(model, x, torch.float16)
    stats, d = _judge(ids, y, has_target, ref, trial, trained=trained,
                      cfg=dataclasses.replace(RULE, outputs={"*": Tolerance(atol=1.0, rtol=0.02)}))
    assert stats.nonfinite.trained.rows == 11 and stats.nonfinite.trained.per_kind == {"edge": 11}
    assert d.decision == "rollback" and d.training == "rollback" and d.inference == "accept"
    assert d.cases["nonfinite_trained"] == tuple(ids[40:])
    assert any("AMP-trained model" in r and "edge/s0x1000" in r for r in d.reasons)


def test_a_non_finite_row_is_a_miss_in_every_metric():
    scores = torch.tensor([[5.0, 1.0, 0.0], [float("nan"), 9.0, 0.0], [0.0, float("inf"), 1.0]])
    y = torch.tensor([0, 1, 1])
    for metric in ("accuracy", "top_k"):
        q = QualityStats(metric, "lowest_index", top_k=2)
        q.update(scores, y)
        assert q.counts() == (1, 3), metric  # before: top_k counted the NaN row's target among its "best" scores


def test_tie_is_flip_two_different_ties_are_a_flip():
    ref = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    trial = torch.tensor([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0]])  # row 0: tied among other classes; row 1: the same tie
    d = DecisionStats(["ordinary/a", "ordinary/b"], ["ordinary", "ordinary"], "tie_is_flip", 0.0, "logit", capacity_tokens=2)
    d.update(0, ref, trial)
    f = d.result()
    assert f.flips == 1 and f.flip_list[0].id == "ordinary/a"


def test_one_miss_in_a_hundred_is_within_a_one_percent_drop():
    q = Quality(metric="accuracy", higher_is_better=True, reference=1.0, trial=0.99, trained=1.0,
                counts={"reference": (100, 100), "trial": (99, 100), "trained": (100, 100)}, paired={})
    j = rule._Judge()
    rule._quality(q, AcceptanceConfig(max_quality_drop=0.01), j, "inference", "trial")
    assert not j.failed["inference"], j.reasons  # before: "drop 0.0100 > 0.01" on rounded fractions
    q = dataclasses.replace(q, counts={**q.counts, "trial": (98, 100)})
    j = rule._Judge()
    rule._quality(q, AcceptanceConfig(max_quality_drop=0.01), j, "inference", "trial")
    assert j.failed["inference"] and "2 case(s) fewer" in j.reasons[0]


def test_streamed_p99_gate_reads_the_upper_edge():
    torch.manual_seed(0)
    values = torch.rand(200_000, dtype=torch.float64) ** 3
    q = StreamQuantile(0.99, values.numel(), max_exact=100)  # forced to the histogram
    q.update(values)
    exact = quantile(values, 0.99)
    assert not q.exact and q.upper() >= exact and q.upper() <= exact * (1 + 2**-9)


def _step(step: int, loss: float, grad_norm: float) -> StepRecord:
    """One step of the reference's training record, as freeze vets it."""
    return StepRecord(step=step, loss=loss, grad_norm=grad_norm, scale=1.0, skipped=False, real_updates=step + 1, lr=0.1)


def test_tiny_scale_regression_refuses_logit_tolerances_and_unknown_names():
    torch.manual_seed(4)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.mul_(1e-7)
        model.bias.mul_(1e-7)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    ref = _fp32(model, x)
    rms = {"output": float(ref["output"].square().mean().sqrt())}
    shapes = {"output": (1,)}
    steps = [_step(0, loss=1e-14, grad_norm=1e-7)]
    shipped = AcceptanceConfig()  # logit defaults: atol 0.05 on outputs of 1e-7
    line = _vet(shipped, "regression", shapes, rms, -1e-8, "neg_rmse", True, steps)
    assert "atol 0.05 is not below the scale of output 'output'" in line
    # float16 predictions of it are noise: relative error about 100 %, yet inside atol 0.05.
    trial = _autocast(model, x, torch.float16)
    assert float(((trial["output"] - ref["output"]).abs() / ref["output"].abs()).median()) > 0.1
    typo = dataclasses.replace(shipped, outputs={"*": Tolerance(atol=1e-10, rtol=0.02), "ouptut": Tolerance(atol=1e-10)})
    assert "'ouptut', which the model does not output; its outputs are 'output'" in _vet(
        typo, "regression", shapes, rms, -1e-8, "neg_rmse", True, steps
    )
    named = dataclasses.replace(shipped, outputs={"output": Tolerance(atol=1e-10)})
    two = {"output": (1,), "aux": (1,)}
    assert "no entry for output 'aux' and no '*'" in _vet(
        named, "regression", two, dict(rms, aux=1e-7), -1e-8, "neg_rmse", True, steps
    )
    scaled = dataclasses.replace(shipped, outputs={"*": Tolerance(atol=1e-10, rtol=0.02)}, min_quality=None)
    assert "max_quality_drop 0.01 is not below the reference's own error" in _vet(
        scaled, "regression", shapes, rms, -1e-8, "neg_rmse", True, steps
    )
    fixed = dataclasses.replace(scaled, max_quality_drop=1e-9)  # no fixed loss band: the noise floor
    assert _vet(fixed, "regression", shapes, rms, -1e-8, "neg_rmse", True, steps) is None


def test_reference_that_is_not_a_baseline_is_refused_at_freeze():
    cfg = AcceptanceConfig(min_quality=0.9)
    shapes, rms = {"output": (10,)}, {"output": 3.0}
    ok = [_step(0, loss=2.3, grad_norm=1.0)]
    assert "does not meet acceptance.min_quality 0.9" in _vet(
        cfg, "classification", shapes, rms, 0.5, "accuracy", True, ok
    )
    nan = [_step(0, loss=2.3, grad_norm=1.0), _step(1, loss=float("nan"), grad_norm=1.0)]
    assert "loss is not finite at step 1" in _vet(cfg, "classification", shapes, rms, 0.95, "accuracy", True, nan)
    assert _vet(cfg, "classification", shapes, rms, 0.95, "accuracy", True, ok) is None


def test_the_digits_examples_floor_is_named_with_the_value_to_set_instead():
    """Issue 51, friction 1: a user's own model refused at freeze by params.yaml's min_quality 0.9 is told that 0.9 is
    the digits example's floor and which value to set instead; that value passes the check, its replicates included."""
    from pipeline.artifacts.comparison import FP32Spread

    shapes, rms, ok = {"output": (10,)}, {"output": 3.0}, [_step(0, loss=2.3, grad_norm=1.0)]
    spread = FP32Spread(metric="accuracy", reference=0.75, replicates=(0.734375,))
    said = _vet(AcceptanceConfig(min_quality=0.9), "classification", shapes, rms, 0.75, "accuracy", True, ok, spread=spread)
    assert "\n" not in said and said.endswith(
        "0.9 is the digits example's floor (params.yaml); set your model's own, at most 0.7343 (what the FP32 reference and "
        "its replicates reach), or min_quality: null"), said
    suggested = float(said.split("at most ")[1].split()[0])
    assert _vet(AcceptanceConfig(min_quality=suggested), "classification", shapes, rms, 0.75, "accuracy", True, ok,
                spread=spread) is None
    # Another floor is the user's own: no word about the example.
    other = _vet(AcceptanceConfig(min_quality=0.8), "classification", shapes, rms, 0.75, "accuracy", True, ok)
    assert "digits example" not in other and other.endswith("or set the minimum it can meet")
    lower = _vet(AcceptanceConfig(min_quality=0.9), "regression", {"output": (1,)}, {"output": 1.0}, 1.23456, "loss",
                 False, ok)
    assert "at least 1.235 (what" in lower, lower


def test_vacuous_passes_become_named_reasons():
    nothing = Distribution(tokens=0, kl_mean=0.0, kl_p99=0.0, kl_p99_upper=0.0, kl_p99_exact=True, kl_max=0.0, top1_agreement=1.0,
                           top_k=5, top_k_overlap=1.0, kl_mean_se=0.0, kl_quantiles={}, kl_quantiles_exact=True,
                           top1_agreement_se=0.0, rms_delta_p=None, store={}, logit_error=0.0, kl_mean_bound=0.0,
                           kl_p99_bound=0.0, kl_max_bound=0.0)
    j = rule._Judge()
    rule._distribution(nothing, AcceptanceConfig(max_kl_mean=0.01), j, None)  # no token: the flips are not read
    assert j.failed["inference"] and "no valid token" in j.reasons[0]
    gap = trajectory_gap([1.0, float("nan")], [1.0, 1.0], 0.05, 0.1)
    assert gap.band_violations == 1  # a NaN reference step is outside any band
    health = update_health([True, True, True], [1.0, 1.0, 1.0, 1.0], [False] * 3, window=10)
    assert health.stalled and health.stall_window == 3  # a run shorter than the window can still stall


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class Sqrt(torch.nn.Module):
    """Finite loss, non-finite gradient: sqrt's derivative at 0 is infinite."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return torch.sqrt(self.lin(x)) - 1.0


def test_bfloat16_never_applies_a_non_finite_gradient():
    torch.manual_seed(5)
    model = Sqrt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.zeros(4, 4)  # lin(x) = 0: sqrt'(0) = inf
    y = torch.tensor([0, 1, 0, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(dtype="bfloat16")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    out = training.amp_step(model, [(x, y)], recipe.make_loss(TaskConfig()), optimizer, scaler, policy, torch.device("cpu"))
    assert math.isfinite(float(out.loss)) and not math.isfinite(float(out.grad_norm))
    assert out.skipped and out.nonfinite_grad
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # before: the weights went NaN
    steps = [step(0, skipped=True, nonfinite_grad=True)] + FLAT[1:]
    ids, scores = ["ordinary/a", "ordinary/b"], {"output": torch.tensor([[2.0, 0.0], [0.0, 2.0]])}
    _, d = _judge(ids, torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool), scores, scores, trial_steps=steps)
    assert d.training == "rollback" and d.inference == "accept" and d.cases == {"steps": (0,)}
    assert any("non-finite gradient norm at step(s) 0" in r for r in d.reasons), d.reasons


def test_designed_gradscaler_skips_do_not_roll_back_but_a_divergence_does():
    """float16 with an initial scale that overflows at the first steps: the scaler skips and backs off, as designed.

    Against the FP32 reference the trial runs behind by the skipped updates and the per-step band fails;
    against FP32 aligned on the same skips it passes. A real divergence (10x the learning rate) still fails."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g) * 4.0  # large enough inputs that 65536 once scales a gradient past float16's range
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    cfg = ReferenceConfig(train_steps=30, batch_size=32, lr=0.5, momentum=0.0, checkpoint_every=0, grad_clip=None)
    device = torch.device("cpu")

    def run(policy, cfg=cfg, skip=frozenset()):
        return training.train(
            _net(), TensorSource(x, y), cfg, TaskConfig(), policy, device, 0, skip_steps=skip, label="t"
        ).records

    ref = run(Policy())
    trial_records = run(Policy(dtype="float16"))
    skipped = [r.step for r in trial_records if r.skipped]
    assert 1 <= len(skipped) <= 3, skipped  # 65536 overflows float16's gradients once; the scale backs off
    trial = trial_records
    aligned = training.aligned_fp32(_net, TensorSource(x, y), cfg, TaskConfig(), device, 0, trial_records, "t")
    acc = dataclasses.replace(RULE, loss_atol=0.05, loss_rtol=0.0)
    naive = streams.training_stats(acc, streams.Trajectories(ref, trial, 1024.0))
    fair = streams.training_stats(acc, streams.Trajectories(ref, trial, 1024.0, aligned=aligned))
    assert naive.band_violations > 0 and fair.band_violations == 0, (naive.max_loss_gap, fair.max_loss_gap)
    harmful = run(Policy(dtype="float16"), dataclasses.replace(cfg, lr=5.0))
    bad = streams.training_stats(acc, streams.Trajectories(ref, harmful, 1024.0, aligned=aligned))
    assert bad.band_violations > 0


def test_the_gradscalers_calibration_skips_at_the_start_are_no_rollback():
    """float16 on inputs 256x larger: the scale starts at 65536 and halves at each of the first updates until the
    scaled gradients fit (PyTorch's AMP docs: « infs/NaNs ... for the first few iterations as its value calibrates »).
    Real training, 40 steps: 6 calibration skips and one more, 7 of 40 (0.175 > max_skipped_fraction 0.1), which rolled
    this healthy run back. The calibration is said in the checks and the limits count the skips after it; the same
    skips at any other time than the opening still roll back, and so does a run that never made a real update."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g) * 256.0
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    cfg = ReferenceConfig(train_steps=40, batch_size=32, lr=0.5 / 256**2, momentum=0.0, checkpoint_every=0, grad_clip=None)
    device, source = torch.device("cpu"), TensorSource(x, y)
    ref = training.train(_net(), source, cfg, TaskConfig(), Policy(), device, 0, label="t").records
    trial = training.train(_net(), source, cfg, TaskConfig(), Policy(dtype="float16"), device, 0, label="t").records
    skipped = [r.step for r in trial if r.skipped]
    assert skipped[:6] == list(range(6)) and len(skipped) / len(trial) > RULE.max_skipped_fraction, skipped
    aligned = training.aligned_fp32(_net, source, cfg, TaskConfig(), device, 0, trial, "t")
    ids, every = [f"ordinary/{i}" for i in range(20)], torch.ones(20, dtype=torch.bool)
    scores = {"output": x[:20, :3] / 256.0}

    def judged(trial_steps, aligned_steps):
        return _judge(ids, scores["output"].argmax(1), every, scores, scores, cfg=RULE, steps=ref, trial_steps=trial_steps,
                      aligned=aligned_steps, scaler=True)

    stats, d = judged(trial, aligned)
    assert stats.training.calibration_steps == 6 and stats.training.skipped_steps == len(skipped)
    assert d.decision == "accept", d.reasons
    assert any("the first 6 update(s) skipped while the GradScaler calibrated its scale" in c for c in d.checks), d.checks
    # The same seven skips in the middle of the run: a scale falling while training, not a calibration.
    moved = tuple(dataclasses.replace(r, skipped=r.step in range(20, 27)) for r in trial)
    moved_aligned = tuple(step(i, r.loss, skipped=i in range(20, 27)) for i, r in enumerate(ref))
    stats, d = judged(moved, moved_aligned)
    assert stats.training.calibration_steps == 0 and d.training == "rollback"
    assert any("7 of 40 updates skipped, fraction 0.175" in r for r in d.reasons), d.reasons
    # Every update skipped: no real update ever came, so nothing calibrated; the run stalled.
    never = tuple(dataclasses.replace(r, skipped=True) for r in trial)
    stats, d = judged(never, tuple(step(i, r.loss, skipped=True) for i, r in enumerate(ref)))
    assert stats.training.calibration_steps == 0 and stats.training.stalled and d.training == "rollback"
    # One forward overflow among the opening skips is an incident of its own, said, and the other five are still the
    # calibration (it cancelled the calibration, and 7 of 40 rolled back).
    overflow = tuple(dataclasses.replace(r, loss=math.inf) if r.step == 3 else r for r in trial)
    stats, d = judged(overflow, aligned)
    assert stats.training.calibration_steps == 5 and d.decision == "accept", d.reasons
    assert any("loss not finite at step 3, its update skipped by the GradScaler: an incident" in c for c in d.checks)
    # Under a rule that judges no quality after training, nothing would show what the opening skips cost (the band holds
    # the trial against FP32 skipping them too): they count (a run left 2 real updates of 18 by them was accepted).
    blind = dataclasses.replace(RULE, max_quality_drop=None, min_quality=None)
    stats = _judge(ids, scores["output"].argmax(1), every, scores, scores, cfg=blind, steps=ref, trial_steps=trial,
                   aligned=aligned, scaler=True)[0]
    d = rule.decide(stats, blind)
    assert stats.training.calibration_steps == 0 and any("7 of 40 updates skipped" in r for r in d.reasons), d.reasons


def test_dropout_inference_draws_from_one_recorded_state():
    """reference.eval_mode: false: FP32 against FP32 must be identical, whatever the RNG did in between."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    x = torch.randn(300, 8)
    first = inference.infer(model, x, Policy(), torch.device("cpu"), eval_mode=False)
    torch.rand(1000)  # freeze and trial reach inference from unrelated RNG states
    again = inference.infer(model, x, Policy(), torch.device("cpu"), eval_mode=False)
    assert torch.equal(first["output"], again["output"])  # before: about half the elements differed
    fp64 = inference.fp64_chunks(model, x, eval_mode=False)
    assert fp64 is not None and fp64.cases == 300 and next(fp64.chunks)["output"].shape == (256, 4)


def test_inference_leaves_the_training_rng_where_it_was():
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    x = torch.randn(50, 8)
    torch.manual_seed(9)
    inference.infer(model, x, Policy(), torch.device("cpu"), eval_mode=False)
    drawn = torch.rand(5)
    torch.manual_seed(9)
    assert torch.equal(drawn, torch.rand(5))


def test_diagnosis_replay_keeps_the_schedule_of_the_run():
    """A replay stopped at step k runs the original schedule (cosine over train_steps), not one rebuilt over k steps."""
    from pipeline.config import LrSchedule

    torch.manual_seed(10)
    x = torch.randn(128, 8)
    y = torch.randint(0, 3, (128,))
    cfg = ReferenceConfig(train_steps=20, batch_size=16, lr=1.0, momentum=0.0, checkpoint_every=0,
                          lr_schedule=LrSchedule(kind="cosine", warmup=0))
    full = training.train(_net(), TensorSource(x, y), cfg, TaskConfig(), Policy(), torch.device("cpu"), 0, label="t").records
    part = training.train(
        _net(), TensorSource(x, y), cfg, TaskConfig(), Policy(), torch.device("cpu"), 0, label="t", stop=10
    ).records
    assert len(part) == 10 and [r.lr for r in part] == [r.lr for r in full[:10]]
    assert [r.loss for r in part] == [r.loss for r in full[:10]]


def test_a_relative_margin_on_two_classes_is_refused_at_freeze():
    """(z1 - z2) / std(z) over two classes is sqrt 2 for every case, however close to a tie: under
    ``boundary_margin_kind: relative`` no two-class case could ever be near the boundary, and ties the guide calls
    boundary cases (1,0000 against 1,0003) would count as clear flips. freeze refuses it in one line."""
    steps = [_step(0, loss=1.0, grad_norm=1.0)]
    relative = AcceptanceConfig(boundary_margin_kind="relative", boundary_margin=0.5, min_quality=None)
    line = _vet(relative, "classification", {"logits": (2,)}, {"logits": 3.0}, 0.9, "accuracy", True, steps)
    assert "boundary_margin_kind relative" in line and "'logits' of 2 class score(s)" in line and "\n" not in line
    assert _vet(relative, "classification", {"logits": (5,)}, {"logits": 3.0}, 0.9, "accuracy", True, steps) is None
    values_only = dataclasses.replace(relative, outputs={"*": Tolerance(), "flag": Tolerance(decisions=False)})
    assert _vet(values_only, "classification", {"logits": (5,), "flag": (1,)}, {"logits": 3.0, "flag": 1.0}, 0.9,
                         "accuracy", True, steps) is None
    assert "'flag' of 1 class score(s)" in _vet(relative, "classification", {"logits": (5,), "flag": (1,)},
                                                         {"logits": 3.0, "flag": 1.0}, 0.9, "accuracy", True, steps)


def test_one_overflowed_step_the_scaler_skipped_is_an_incident_not_a_rollback():
    """float16: the forward of step 5 overflows (loss inf), the GradScaler skips its update, training goes on and
    matches FP32 aligned on that skip. The guide: « un incident ponctuel ne suffit pas à déclarer un entraînement
    inutilisable : examinez sa fréquence, la progression et la qualité ». The step is said in the checks and left out
    of the band; the same overflow applied (no skip) still rolls back, and so do overflows every fifth step. Overflows
    at 3 steps of 60, within the skip limit, are no incident but a forward overflow that repeats (« une baisse répétée
    de l'échelle n'établit donc pas que le problème est résolu »), which no loss scale fixes: rolled back, naming them."""
    ref_steps = tuple(step(i, 2.0 / (1 + i / 20)) for i in range(60))
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(0)) * 3
    ids, every = [f"ordinary/{i}" for i in range(20)], torch.ones(20, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, loss_noise_multiple=None)

    def judged(overflow, skipped):
        trial = tuple(step(i, math.inf if overflow(i) else s.loss, skipped=skipped and overflow(i))
                      for i, s in enumerate(ref_steps))
        aligned = tuple(step(i, s.loss, skipped=overflow(i)) for i, s in enumerate(ref_steps)) if skipped else None
        return _judge(ids, x.argmax(1), every, {"output": x}, {"output": x.clone()}, cfg=cfg, steps=ref_steps,
                      trial_steps=trial, aligned=aligned, scaler=True)

    stats, d = judged(lambda i: i == 5, skipped=True)
    assert d.decision == "accept" and stats.training.excused_steps == (5,), d.reasons
    assert any("loss not finite at step 5, its update skipped by the GradScaler" in c for c in d.checks), d.checks
    assert "training: every loss finite but step 5" in d.checks
    _, d = judged(lambda i: i == 5, skipped=False)
    assert d.training == "rollback" and any(r.startswith("training: loss not finite from step 5") for r in d.reasons)
    _, d = judged(lambda i: i % 5 == 0, skipped=True)
    assert d.training == "rollback" and any("updates skipped, fraction 0.2" in r for r in d.reasons), d.reasons
    stats, d = judged(lambda i: i in (10, 30, 50), skipped=True)
    assert stats.training.skipped_fraction <= cfg.max_skipped_fraction  # the skip limits alone would accept
    assert d.training == "rollback" and any(
        r.startswith("training: loss not finite at 3 steps (10, 30, 50), each update skipped") for r in d.reasons), d.reasons
    assert not any(c.startswith("training: every loss finite") for c in d.checks)


class _MaskedActions(torch.nn.Module):
    """A policy's action scores with illegal actions masked the Hugging Face / RL way,
    ``masked_fill(~allowed, torch.finfo(logits.dtype).min)``: -3.4e38 under FP32, -65504 under a float16 autocast."""

    def __init__(self, illegal=(4, 5), fill="finfo"):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.body, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 6)
        self.illegal, self.fill = list(illegal), fill
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.head.weight.mul_(3.0)

    def forward(self, x):
        logits = self.head(torch.tanh(self.body(x)))
        allowed = torch.ones_like(logits, dtype=torch.bool)
        allowed[:, self.illegal] = False
        if self.fill == "-inf":  # torch.distributions.Categorical's docs, Hugging Face's logits processors
            return logits.masked_fill(~allowed, -math.inf)
        if self.fill == "-1e9":  # CleanRL's CategoricalMasked: -inf under a float16 autocast (-1e9 overflows float16)
            return torch.where(allowed, logits, torch.tensor(-1e9))
        return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)


def test_a_class_masked_with_the_dtypes_minimum_on_both_sides_is_no_value_gap():
    """Illegal actions masked with the dtype's minimum are at probability exactly 0 under FP32 (-3.4e38) and under the
    float16 trial (-65504): no decision, no probability changes, yet their value gap (3.4e38) failed every rtol < 1,
    and every float16 trial of such a model rolled back. Such pairs agree (counted in ``zero_probability_both``, out of
    the gap figures); freeze accepts the reference. A trial that unmasks an action the reference masks, or masks a
    legal one, changes a probability from or to 0: still a rollback."""
    from pipeline import cases, config, vetting
    from pipeline.artifacts import reference_tensors

    model = _MaskedActions()
    n = 300
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(6))
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    ref = _fp32(model, x)
    y = ref["output"].argmax(1)
    trial = _autocast(model, x, torch.float16)
    assert float(ref["output"][0, 5]) == torch.finfo(torch.float32).min and float(trial["output"][0, 5]) == -65504.0
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)})
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="classification"), acceptance=cfg)
    scan, refused = vetting.Scan(params, cases.Cases(ids=ids, x=x, y=y, has_target=every)), []
    list(reference_tensors._checked([ref], ids, refused, scan))
    assert refused == [] and scan.problem(FLAT) is None  # finite, and a rule this reference can be judged by
    stats, d = _judge(ids, y, every, ref, trial, cfg=cfg)
    assert d.decision == "accept", d.reasons
    gap = stats.values["output"]
    assert gap.zero_probability_both == 2 * n and gap.failing == 0 and gap.elements == 6 * n
    assert gap.max_abs < 0.1 and gap.min_passing_atol <= 0.05 and gap.failing_ids is None  # the legal scores alone
    model.illegal = [5]  # the trial lets action 4 through: finite, and likely, where the reference says impossible
    unmasked = _autocast(model, x, torch.float16)
    model.illegal = [0, 4, 5]  # the trial rules out action 0, legal in the reference
    masked = _autocast(model, x, torch.float16)
    for changed, both_masked in ((unmasked, n), (masked, 2 * n)):
        stats, d = _judge(ids, y, every, ref, changed, cfg=cfg)
        gap = stats.values["output"]
        assert d.decision == "rollback" and any(r.startswith("values 'output': 300 of 1800") for r in d.reasons), d.reasons
        assert gap.failing == n and gap.zero_probability_both == both_masked and len(gap.failing_ids) == n


def test_a_class_masked_with_minus_inf_or_with_a_constant_float16_overflows_is_no_fault():
    """-inf is how PyTorch's and Hugging Face's docs mask a class (probability exactly 0, as ``torch.softmax`` gives it),
    and ``torch.where(allowed, logits, -1e9)`` writes -inf under a float16 autocast: neither is a non-finite output while
    the row's maximum is finite. Freeze accepts such a reference, and a healthy float16 trial is accepted on inference
    and training (its AMP-trained model's outputs hold the same masks; its accuracy is the reference's). A legal class
    sent to -inf, or an illegal one let through, is still a rollback, and so is a row masked whole (no finite maximum:
    softmax gives NaN)."""
    from pipeline import cases, config, vetting
    from pipeline.artifacts import reference_tensors

    n = 300
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(6))
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)}, min_quality=0.5)
    for fill, masked_in_trial in (("-inf", -math.inf), ("-1e9", -math.inf)):
        model = _MaskedActions(fill=fill)
        ref = _fp32(model, x)
        y = ref["output"].argmax(1)
        trial = _autocast(model, x, torch.float16)
        assert float(trial["output"][0, 5]) == masked_in_trial
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="classification"), acceptance=cfg)
        scan, refused = vetting.Scan(params, cases.Cases(ids=ids, x=x, y=y, has_target=every)), []
        list(reference_tensors._checked([ref], ids, refused, scan))
        assert refused == [] and scan.problem(FLAT) is None, (fill, refused)
        assert scan.rms()["output"] < 100.0  # the legal scores' scale: a masked class is no score
        stats, d = _judge(ids, y, every, ref, trial, cfg=cfg)
        assert d.decision == "accept" and d.training == "accept", (fill, d.reasons)
        gap = stats.values["output"]
        assert gap.zero_probability_both == 2 * n and gap.nonfinite_trial_only == 0 and gap.failing == 0, (fill, gap)
        assert stats.nonfinite.trained.rows == 0 and stats.quality.trained == stats.quality.reference == 1.0
        model.illegal = [0, 4, 5]  # the trial rules out action 0, legal in the reference
        masked = _autocast(model, x, torch.float16)
        model.illegal = [5]  # the trial lets action 4 through
        unmasked = _autocast(model, x, torch.float16)
        for changed in (masked, unmasked):
            stats, d = _judge(ids, y, every, ref, changed, cfg=cfg)
            assert d.decision == "rollback" and any(r.startswith("values 'output': 300 of 1800") for r in d.reasons), (
                fill, d.reasons)
    whole = {"output": ref["output"].clone()}
    whole["output"][:3] = -math.inf  # three rows with every class masked: no distribution at all
    stats, d = _judge(ids, y, every, ref, whole, cfg=cfg)
    assert stats.nonfinite.trained.rows == 3 and stats.values["output"].nonfinite_trial_only == 3 * 6
    assert d.decision == "rollback" and any("AMP-trained model: 3 case(s)" in r for r in d.reasons), d.reasons


class _LeftPaddedTagger(torch.nn.Module):
    """One causal attention layer over left-padded sequences, written by hand as models often are
    (``masked_fill(~allowed, -inf).softmax(-1)``): a padded query sees no key, and its row of weights is NaN, on every
    side, FP32 included. ``attention_mask`` says those positions are padding."""

    def __init__(self, vocab=16, width=32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.qkv, self.out = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, 3 * width), torch.nn.Linear(
            width, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, batch):
        h = self.emb(batch["input_ids"])
        q, k, v = self.qkv(h).chunk(3, -1)
        length = h.shape[1]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()[None] & batch["attention_mask"].bool()[:, None, :]
        w = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~allowed, -math.inf).softmax(-1)
        return {"logits": self.out(h + w @ v)}


def test_non_finite_scores_at_padding_only_are_no_reason_to_refuse_the_reference():
    """Freeze refuses a reference that is not finite where compare judges it, and only there: NaN at the padded positions
    of a left-padded batch (their attention rows see nothing) is no output the application uses, on any side. Freeze
    accepts the reference; float16 and bfloat16 trials are judged on the real positions. The same NaN at a real position
    is refused, naming the case."""
    from pipeline import cases, config, vetting
    from pipeline.artifacts import reference_tensors

    n, length = 120, 10
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, length + 1, (n,), generator=g)
    pos = torch.arange(length)[None]
    mask = (pos >= length - lengths[:, None]).long()  # left padding
    tokens = torch.randint(1, 16, (n, length), generator=g) * mask
    targets = torch.where(mask.bool() & (pos < length - 1), tokens.roll(-1, 1), torch.full_like(tokens, -100))
    x = {"input_ids": tokens, "attention_mask": mask}
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    model = _LeftPaddedTagger().eval()
    ref = _fp32(model, x)
    padded = ~mask.bool()
    assert bool(torch.isnan(ref["logits"][padded]).all()) and bool(torch.isfinite(ref["logits"][~padded]).all())
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.1, rtol=0.05)}, max_near_boundary_flips=None)
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="classification"), acceptance=cfg)
    fixed = cases.Cases(ids=ids, x=x, y=targets, has_target=every)
    refused, scan = [], vetting.Scan(params, fixed)
    list(reference_tensors._checked([ref], ids, refused, scan))
    assert refused == [] and 1.0 < scan.rms()["logits"] < 10.0  # the scale of the real positions' scores (atol's bar)
    for dtype in (torch.float16, torch.bfloat16):
        trial = _autocast(model, x, dtype)
        sources = streams.Sources(ids, targets, every, streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trial),
                                  token_mask=mask)
        stats, _ = streams.compare_streams("classification", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0))
        assert stats.values["logits"].nonfinite_trial_only == stats.nonfinite.trained.rows == 0, dtype
        assert stats.values["logits"].elements == int(mask.sum()) * 16
    broken = {"logits": ref["logits"].clone()}
    broken["logits"][7, -1, 3] = math.nan  # the last position is real in every sequence
    refused = []
    list(reference_tensors._checked([broken], ids, refused, vetting.Scan(params, fixed)))
    assert refused == ["ordinary/s7"]


def test_only_class_scores_decided_through_softmax_excuse_a_pair_at_probability_zero():
    """The same far-below-the-row values, -1e5 against -2e5, are probability 0 in a classifier's scores (accepted,
    counted) but a regression's quantities (a 100% error: rolled back): no other output is excused."""
    g = torch.Generator().manual_seed(7)
    n = 200
    scores = torch.randn(n, 3, generator=g)
    ref, trial = scores.clone(), scores.clone()
    ref[:, 2], trial[:, 2] = -1e5, -2e5
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    stats, d = _judge(ids, scores.argmax(1), every, {"output": ref}, {"output": trial})
    assert d.decision == "accept" and stats.values["output"].zero_probability_both == n, d.reasons
    stats, d = _judge(ids, scores[:, :1].clone(), every, {"output": ref}, {"output": trial})  # a regression
    assert stats.regression is not None and stats.values["output"].zero_probability_both is None
    assert d.decision == "rollback" and any(r.startswith(f"values 'output': {n} of {3 * n}") for r in d.reasons), d.reasons


def test_every_head_of_a_hugging_face_output_is_judged():
    """YOLOS (transformers, random init) returns class ``logits`` and ``pred_boxes`` in one ``ModelOutput``. A trial
    whose box head is off by far more than the tolerance, its class scores untouched, rolls back naming
    ``pred_boxes``: an untested head is no accept. The boxes are coordinates, judged on their values, not argmaxed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      image_size=[32, 32], patch_size=8, num_detection_tokens=3, num_labels=3)
    model = transformers.YolosForObjectDetection(config)
    x = Batch(pixel_values=torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    cpu = torch.device("cpu")
    ref = inference.infer(model, x, Policy(), cpu, eval_mode=True)
    assert set(ref) == {"logits", "pred_boxes"}  # last_hidden_state, beside a head, is an inner state
    with torch.no_grad():
        model.bbox_predictor.layers[-1].bias.add_(2.0)  # sigmoid(z + 2): boxes moved by ~0.1-0.4, logits untouched
    trial = inference.infer(model, x, Policy(), cpu, eval_mode=True)
    assert torch.equal(trial["logits"], ref["logits"])
    y = ref["logits"][:, :, :-1].argmax(-1)
    ids = [f"ordinary/s{i}" for i in range(64)]
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)})
    stats, d = _judge(ids, y, torch.ones(64, 3, dtype=torch.bool), ref, trial, cfg=cfg)
    assert d.decision == "rollback" and any("pred_boxes" in reason for reason in d.reasons), d.reasons
    assert "pred_boxes" not in stats.heads  # coordinates: values, never argmaxed
    stats, d = _judge(ids, y, torch.ones(64, 3, dtype=torch.bool), ref, ref, cfg=cfg)
    assert d.decision == "accept", d.reasons


def _per_token_values(n=240, length=8, width=4):
    """A regression per token over sequences padded on either side (an ``attention_mask``, every position padding in
    some rows): a real two-layer head, one value per position, returned as [N, T, 1] and, squeezed, as [N, T]."""
    g = torch.Generator().manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    mask = torch.zeros(n, length, dtype=torch.long)
    for i in range(n):
        real = 2 + i % 5  # odd rows left-padded, even rows right-padded
        if i % 2:
            mask[i, length - real:] = 1
        else:
            mask[i, :real] = 1
    features = torch.randn(n, length, width, generator=g)
    features[~mask.bool()] = 1e3 * torch.randn(int((~mask.bool()).sum()), width, generator=g)  # whatever padding holds
    return net, features, mask, g


def test_a_value_per_position_returned_as_n_by_t_is_judged_at_the_kept_positions_alone():
    """A per-token regression squeezed to [N, T] is per token, as [N, T, 1] is: its targets are [N, T] and the mask has
    their shape. Before, it was judged as [N, D] columns: a healthy bfloat16 trial rolled back on values at padding (where
    the features are garbage), and a trial 0.15 off at every real position (RMSE x3) was accepted, its quality measured
    against the -100 written into the padded targets. Both shapes now get the verdicts the method argues, and freeze
    measures the reference's quality where compare does."""
    from pipeline import cases, config, vetting

    net, features, mask, g = _per_token_values()
    n = features.shape[0]
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.2, rtol=0.0)}, max_quality_drop=0.01)
    with torch.no_grad():
        ref = net(features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = net(features).float()
    real = mask.bool()
    assert float((bf16 - ref)[real].abs().max()) < 0.1 and float((bf16 - ref)[~real].abs().max()) > 0.2
    y = (ref.squeeze(-1) + 0.05 * torch.randn(ref.shape[:2], generator=g)) * mask
    for squeeze in (False, True):
        r, healthy, biased = ((v.squeeze(-1) if squeeze else v) for v in (ref, bf16, bf16 - 0.15))
        verdicts = {}
        for label, trial in (("healthy", healthy), ("biased", biased)):
            sources = streams.Sources(ids, y, every, streams.InMemory({"output": r}), streams.InMemory({"output": trial}),
                                      streams.InMemory({"output": trial}), token_mask=mask)
            stats, _ = streams.compare_streams("regression", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0))
            verdicts[label] = rule.decide(stats, cfg)
            assert stats.values["output"].elements == int(real.sum()), squeeze
            if label == "healthy":
                rmse = float((r - (y if squeeze else y[..., None]))[real].pow(2).mean().sqrt())
                assert stats.quality.reference == pytest.approx(-rmse, rel=1e-6), squeeze  # real positions' RMSE
        assert verdicts["healthy"].decision == "accept", (squeeze, verdicts["healthy"].reasons)
        assert verdicts["biased"].decision == "rollback", squeeze
        assert any(x.startswith("quality inference") for x in verdicts["biased"].reasons), verdicts["biased"].reasons
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="mse"), acceptance=cfg)
        scan = vetting.Scan(params, cases.Cases(ids=ids, x={"values": features, "attention_mask": mask}, y=y, has_target=every))
        scan.update(0, {"output": r})
        assert scan.quality.result() == pytest.approx(stats.quality.reference, rel=1e-6), squeeze


def test_a_value_per_position_is_judged_alike_whatever_the_padding_and_the_chunking():
    """A per-token regression [N, T] whose first rows hold no padding: a slice of them was judged as T columns (each
    position a quantity with its own quality gate), one with padding as positions, so the statistics, and the verdict,
    hung on ``compare.chunk_elements`` and on the model returning [N, T] or [N, T, 1]. They are one now, and equal the
    RMSE over the real positions."""
    net, features, mask, g = _per_token_values(n=120)
    mask[:60] = 1  # rows 0-59 whole: a chunk of them has no padding
    features[:60] = torch.randn(60, *features.shape[1:], generator=g)  # real features at their positions
    n = features.shape[0]
    with torch.no_grad():
        ref = net(features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trial = net(features).float()
    y = (ref.squeeze(-1) + 0.05 * torch.randn(ref.shape[:2], generator=g)) * mask
    ids, every, real = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool), mask.bool()
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.2, rtol=0.0)}, max_quality_drop=0.01)
    rmse = {side: -float((v.squeeze(-1) - y)[real].pow(2).mean().sqrt()) for side, v in (("reference", ref), ("trial", trial))}
    for squeeze in (False, True):
        r, t = (v.squeeze(-1) if squeeze else v for v in (ref, trial))
        for chunk in (10**9, 8 * 30):  # every row at once; 30 rows a chunk, the first two without padding
            sources = streams.Sources(ids, y, every, streams.InMemory({"output": r}), streams.InMemory({"output": t}),
                                      streams.InMemory({"output": t}), token_mask=mask)
            stats, _ = streams.compare_streams("regression", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0),
                                               cfg=CompareConfig(chunk_elements=chunk))
            assert stats.quality.columns is None, (squeeze, chunk)
            assert stats.quality.reference == pytest.approx(rmse["reference"], rel=1e-6), (squeeze, chunk)
            assert stats.quality.trial == pytest.approx(rmse["trial"], rel=1e-5), (squeeze, chunk)
            assert rule.decide(stats, cfg).decision == "accept", (squeeze, chunk)


def test_freeze_measures_a_value_per_position_where_compare_judges_it():
    """freeze's scale and spread of a per-token regression [N, T] read every position, padding too, each position a
    column: an output of 5.0 +- 0.01 at every real position, with whatever the padding holds, escaped the refusal of a
    tolerance wider than its spread (a trial answering 5.0 everywhere passes), a head zeroed at padding had a position's
    scale pulled to 0 and a sound tolerance refused, and past freeze's first chunk NaN at padding refused the reference.
    [N, T] is now measured as [N, T, 1] is, in every chunk: at the real positions, one column."""
    from pipeline import cases, vetting
    from pipeline.config import Params

    n, length = 200, 6
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(length)[None] < torch.randint(2, length + 1, (n,), generator=g)[:, None]).long()
    mask[:2] = 0
    mask[:2, 0] = 1  # position 5 of only a few rows is real
    offset = 5.0 + 0.01 * torch.randn(n, length, generator=g)
    padded = torch.where(mask.bool(), offset, 100 * torch.randn(n, length, generator=g))
    zeroed = torch.where(mask.bool(), torch.randn(n, length, generator=g), torch.zeros(n, length))
    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x={"values": torch.randn(n, length, 3, generator=g),
                                                                    "attention_mask": mask},
                        y=offset * mask, has_target=torch.ones(n, dtype=torch.bool))

    def vetted(output, atol):
        params = Params(task=TaskConfig(kind="regression", loss="mse"),
                        acceptance=dataclasses.replace(RULE, outputs={"*": Tolerance(atol=atol, rtol=0.0)}))
        scan = vetting.Scan(params, fixed)
        scan.update(0, {"output": output[:90]})
        scan.update(90, {"output": output[90:]})
        return scan.problem([step(0, 1.0)])

    holes = torch.where(mask.bool(), offset, torch.full_like(offset, math.nan))  # NaN at padding: no output judged
    broken = holes.clone()
    broken[100, 0] = math.nan  # position 0 is real in every row
    for shaped in (lambda v: v, lambda v: v[..., None]):
        line = vetted(shaped(padded), 0.05)
        assert line is not None and "is not below the spread of output 'output'" in line, line
        assert vetted(shaped(padded), 0.001) is None and vetted(shaped(holes), 0.001) is None
        assert vetted(shaped(zeroed), 0.02) is None  # RMS 1 at every real position: 0.02 is well below it
        scan = vetting.Scan(Params(task=TaskConfig(kind="regression", loss="mse"), acceptance=RULE), fixed)
        assert not any(bool(scan.nonfinite_rows(a, {"output": shaped(holes)[a:b]}).any()) for a, b in ((0, 90), (90, n)))
        assert torch.nonzero(scan.nonfinite_rows(90, {"output": shaped(broken)[90:]})).flatten().tolist() == [10]


def test_a_regression_primary_named_like_logits_is_decided_without_a_threshold():
    """A multi-label head (one logit per label, [N, L]) and a one-logit head ([N, 1]) are regressions for the
    pipeline, as a classification's refusal advises. Without ``acceptance.threshold`` their decisions went unjudged: a
    label crossing 0 by less than atol was accepted. A primary named like logits, with targets that are labels (0 or 1),
    is decided at 0, like probabilities at 0.5, each label on its own; said ``decisions: false``, or with targets that
    are values (Hugging Face's regression head, also named logits), by its values alone."""
    g = torch.Generator().manual_seed(6)
    n = 300
    for labels in (5, 1):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, labels))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            x = torch.randn(n, 8, generator=g)
            ref = net(x)
        y = (ref > 0).float()
        row, col = divmod(int(ref.abs().argmin()), labels)  # the logit nearest 0
        trial = ref.clone()
        trial[row, col] = -0.001 * ref[row, col].sign()  # its label flips, by less than atol
        assert float((trial - ref).abs().max()) < 0.05
        ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
        cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.0)})
        for name, r, t in (("logits", ref, trial), ("probs", torch.sigmoid(ref), torch.sigmoid(trial))):
            stats, d = _judge(ids, y, every, {name: r}, {name: t}, cfg=cfg)
            assert stats.flips.real_flips == 1 and stats.flips.flip_list[0].id == f"ordinary/s{row}", (labels, name)
            assert d.decision == "rollback", (labels, name, d.reasons)
            _, d = _judge(ids, y, every, {name: r}, {name: r}, cfg=cfg)
            assert d.decision == "accept", (labels, name, d.reasons)
        values = dataclasses.replace(cfg, outputs={"*": Tolerance(atol=0.05, rtol=0.0, decisions=False)})
        stats, d = _judge(ids, y, every, {"logits": ref}, {"logits": trial}, cfg=values)
        assert stats.flips.real_flips == 0 and d.decision == "accept", (labels, d.reasons)
        # Hugging Face's regression head (num_labels=1, problem_type="regression") is named logits too: with targets of
        # values, not labels, its values crossing 0 by less than atol are no decision, and the verdict is the values'.
        stats, d = _judge(ids, ref + 0.01 * torch.randn(ref.shape, generator=g), every, {"logits": ref}, {"logits": trial},
                          cfg=dataclasses.replace(cfg, max_quality_drop=None))
        assert stats.flips.real_flips == 0 and d.decision == "accept", (labels, d.reasons)


def test_a_regression_whose_primary_only_alphabetical_order_would_name_is_refused():
    """A heteroscedastic regression returns {mean, log_var}: its quality, decisions and loss were read from 'log_var',
    first by name, so a trained trial whose mean was destroyed was accepted. Two such outputs name no primary: refused
    in one line before any training; 'output' or a name ending like a prediction names it. A classification's primary
    is checked by its shape (CLIP's two logits_per_ heads stay as they are)."""
    from pipeline import task
    from pipeline.errors import UserError

    n = 8
    mean, log_var, targets = torch.randn(n, 1), torch.randn(n, 1), torch.randn(n, 1)
    with pytest.raises(UserError) as err:
        task.check_outputs({"mean": mean, "log_var": log_var}, "regression", n, targets, "mypkg:net")
    line = str(err.value)
    assert "'log_var', 'mean'" in line and "'output'" in line and "\n" not in line
    for named in ({"output": mean, "log_var": log_var}, {"mean_pred": mean, "log_var": log_var}, {"mean": mean}):
        task.check_outputs(named, "regression", n, targets, "mypkg:net")
    task.check_outputs({"logits_per_image": torch.randn(n, n), "logits_per_text": torch.randn(n, n)}, "classification", n,
                       torch.arange(n), "mypkg:clip")


def test_an_encoder_decoders_outputs_are_masked_by_the_decoders_padding_not_the_encoders():
    """Hugging Face T5 (random init) whose sources and targets are padded to one length: the batch's ``attention_mask``
    is the encoder's, and taking it for the decoder's positions dropped every real target past a source's length from
    flips, values and quality, so a flipped decoder token under real bfloat16 autocast was accepted. The decoder's own
    ``decoder_attention_mask`` is the mask when given; without it, the -100 targets are."""
    transformers = pytest.importorskip("transformers")
    from pipeline import task

    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=64)).eval()
    n, length = 64, 12
    g = torch.Generator().manual_seed(1)
    source_length = torch.randint(3, 7, (n,), generator=g)
    encoder_mask = (torch.arange(length)[None] < source_length[:, None]).long()
    labels = torch.randint(2, 64, (n, length), generator=g)  # every decoder position holds a real target
    x = {"input_ids": torch.randint(2, 64, (n, length), generator=g) * encoder_mask, "attention_mask": encoder_mask,
         "decoder_input_ids": torch.cat([torch.zeros(n, 1, dtype=torch.long), labels[:, :-1]], 1)}
    with torch.no_grad():
        ref = {"logits": model(**x).logits}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trial = {"logits": model(**x).logits.float()}
    flipped = ref["logits"].argmax(-1) != trial["logits"].argmax(-1)
    assert bool((flipped & ~encoder_mask.bool()).any())  # a real decoder token past its source's length
    assert task.token_mask_of(x) is None
    decoder_mask = torch.ones(n, length, dtype=torch.long)
    assert task.token_mask_of({**x, "decoder_attention_mask": decoder_mask}) is decoder_mask
    assert task.token_mask_of({"input_ids": x["input_ids"], "attention_mask": encoder_mask}) is encoder_mask
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)})
    sources = streams.Sources(ids, labels, every, streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trial),
                              token_mask=task.token_mask_of(x))
    stats, _ = streams.compare_streams("classification", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0))
    assert stats.flips.cases == n * length and stats.flips.real_flips == int(flipped.sum())
    assert rule.decide(stats, cfg).decision == "rollback"


def test_whole_numbers_a_trial_cannot_change_by_one_are_refused_at_freeze():
    """Two outputs of whole numbers a trial may change by one unseen. A decided head [N, C >= 2] of bin indices (a
    Pix2Seq-like box head, argmax over 1000 bins per coordinate), which the decided heads' exemption from the
    whole-number check let through: real bfloat16 moves boxes by a bin or two while the argmax over the 4 coordinates never
    changes. And int64 item ids beyond 2**24, recorded in float32 like every output, where no tolerance can see a change
    (float32 cannot tell n from n + 1 there): the README's own fix for ids, {atol: 0.5, rtol: 0}, accepted 1 id in 2
    changed under bfloat16; recording refuses them in one line. A float regression whose values all lie beyond 2**24
    (every float32 there is whole) is no output of whole numbers."""
    from pipeline import cases, config
    from pipeline.errors import UserError
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(5)

    class Detector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.cls, self.box = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3), torch.nn.Linear(32, 4 * 1000)
            self.item = torch.nn.Linear(32, 4)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                self.cls.weight.mul_(10.0)
                # four near-tied items (one common row plus small differences), as a catalogue of similar items gives
                self.item.weight.copy_(torch.randn(1, 32, generator=g) + 0.002 * torch.randn(4, 32, generator=g))
                self.item.bias.zero_()

        def forward(self, x):
            h = torch.tanh(self.body(x))
            items = torch.tensor([123456789, 123456790, 123456791, 123456792])
            return {"logits": self.cls(h), "bins": self.box(h).unflatten(-1, (4, 1000)).argmax(-1),
                    "item_id": items[self.item(h).argmax(-1)], "pressure": 3.0e7 + 1e5 * torch.tanh(self.cls(h)[:, 0])}

    model, n = Detector(), 300
    x = torch.randn(n, 16, generator=g)
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    with torch.no_grad():
        exact = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
    assert bool((exact["bins"] != amp["bins"]).any()) and bool((exact["item_id"] != amp["item_id"]).any())
    assert bool((exact["item_id"].float() == amp["item_id"].float()).all())  # float32 sees no changed id
    with pytest.raises(UserError, match=r"output 'item_id' holds integers up to 123,456,792, beyond 2\*\*24"):
        inference.recorded("item_id", exact["item_id"])
    recorded = {k: inference.recorded(k, v) for k, v in exact.items() if k != "item_id"}
    y = recorded["logits"].argmax(1)

    def vetted(outputs, names):
        rule_ = dataclasses.replace(RULE, outputs=outputs)
        scan = Scan(dataclasses.replace(config.Params(), acceptance=rule_), cases.Cases(ids=ids, x=x, y=y, has_target=every))
        scan.update(0, {k: recorded[k] for k in names})
        return scan.problem([_step(0, loss=10.0, grad_norm=1.0)])

    line = vetted({"*": Tolerance()}, ("logits", "bins"))
    assert line is not None and "reaches 1 on output 'bins'" in line, line  # decided, yet whole numbers
    assert vetted({"*": Tolerance(), "bins": Tolerance(atol=0.5, rtol=0.0)}, ("logits", "bins")) is None
    assert bool((recorded["pressure"] == recorded["pressure"].round()).all())  # float32 beyond 2**24
    relative = Tolerance(atol=0.0, rtol=0.001, decisions=False)
    assert vetted({"*": Tolerance(), "pressure": relative}, ("logits", "pressure")) is None


def test_outputs_the_rule_would_read_wrongly_are_refused_at_freeze():
    """Three outputs whose decisions or distributions compare would misread, each refused at freeze in one line:
    - a single-value head named like a probability that holds log-probabilities (``log_prob`` = logsigmoid, all <= 0):
      decided at 0.5, none of its decisions could flip (the probe that found it: 4 real bfloat16 flips in 3,000 cases);
    - per-token probabilities [N, T, V] (``probs``, a softmax's output) under the LM rule's KL criteria: KL is taken
      through softmax, and softmax of probabilities is nearly uniform, so a trial that moves the tail's mass (true KL about
      0.5 nats a token, every argmax and every element within tolerance) passed max_kl_mean 0.01;
    - a segmentation head [N, C, H, W] (channels first): freeze's quality raised a shape error, a traceback."""
    from pipeline import cases, config
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(3)
    n, length, vocab = 300, 8, 32
    body, head = torch.nn.Linear(16, 3), torch.nn.Linear(16, 1)
    tokens = torch.nn.Linear(16, vocab)
    seg = torch.nn.Conv2d(3, 5, 1)
    with torch.no_grad():
        for p in [*body.parameters(), *head.parameters(), *tokens.parameters(), *seg.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g))
        tokens.weight.mul_(2.0)
        tokens.bias.zero_()
        tokens.bias[0] = 4.0
    x = torch.randn(n, 16, generator=g)
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    steps = [_step(0, loss=10.0, grad_norm=1.0)]

    def vetted(outputs, y, inputs, rule_=RULE):
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="classification"), acceptance=rule_)
        scan = Scan(params, cases.Cases(ids=ids, x=inputs, y=y, has_target=every))
        scan.update(0, outputs)
        return scan.problem(steps)

    with torch.no_grad():
        logits, z = body(x), head(torch.tanh(x))
        log_prob = torch.nn.functional.logsigmoid(z)
    assert bool((log_prob >= math.log(0.5)).any()) and not bool((log_prob >= 0.5).any())  # class 1 seen by no 0.5
    line = vetted({"logits": logits, "log_prob": log_prob}, logits.argmax(1), x)
    assert line is not None and "output 'log_prob'" in line and "outside [0, 1]" in line, line
    assert vetted({"logits": logits, "log_logit": log_prob}, logits.argmax(1), x) is None  # a logit may be negative

    sequences = torch.randn(n, length, 16, generator=g)
    with torch.no_grad():
        probs = torch.softmax(tokens(sequences), -1)
    lm = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)}, max_kl_mean=0.01, max_kl_p99=0.05)
    batch = {"values": sequences, "attention_mask": torch.ones(n, length, dtype=torch.long)}
    line = vetted({"probs": probs}, probs.argmax(-1), batch, lm)
    assert line is not None and "output 'probs' holds probabilities" in line and "log-probabilities" in line, line
    assert vetted({"probs": probs.log()}, probs.argmax(-1), batch, lm) is None  # log p: softmax gives p back

    images = torch.randn(n, 3, 6, 6, generator=g)
    with torch.no_grad():
        scores = seg(images)
    line = vetted({"logits": scores}, scores.argmax(1), images)
    assert line is not None and "[N, 5, 6, 6]" in line, line


def test_a_top_k_metric_with_k_not_below_the_classes_is_refused_at_freeze():
    """metric ``top_k`` with k 5 on a 3-class classifier: every target is among the top 5 of every case, reference and
    trial alike, so quality is 1.0 whatever the trial answers and min_quality / max_quality_drop cannot fail. Freeze
    refuses it in one line naming k, the classes and the fix; k 2 passes, and so does k 5 once no quality criterion is
    set (nothing depends on it then)."""
    steps = [step(i, 1.0) for i in range(4)]
    shapes, rms = {"logits": (3,)}, {"logits": 3.0}
    line = _vet(AcceptanceConfig(), "classification", shapes, rms, 1.0, "top_k", True, steps, top_k=5)
    assert line is not None and "task.top_k 5 is not below the 3 classes" in line and "metric: accuracy" in line, line
    assert _vet(AcceptanceConfig(), "classification", shapes, rms, 0.95, "top_k", True, steps, top_k=2) is None
    without = AcceptanceConfig(max_quality_drop=None, min_quality=None)
    assert _vet(without, "classification", shapes, rms, 1.0, "top_k", True, steps, top_k=5) is None
    per_token = {"logits": (7, 4)}  # [N, T, 4]: the classes are the last axis
    line = _vet(AcceptanceConfig(), "classification", per_token, rms, 1.0, "top_k", True, steps, top_k=4)
    assert line is not None and "4 classes" in line, line

    from pipeline import cases, config
    from pipeline.vetting import Scan

    g = torch.Generator().manual_seed(0)  # and through freeze's scan, with the task's own top_k
    x = torch.randn(40, 4, generator=g)
    logits = x[:, :3] * 3
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="classification", metric="top_k", top_k=3),
                                 acceptance=dataclasses.replace(RULE, min_quality=0.5))
    scan = Scan(params, cases.Cases(ids=[f"ordinary/s{i}" for i in range(40)], x=x, y=logits.argmax(1),
                                    has_target=torch.ones(40, dtype=torch.bool)))
    scan.update(0, {"logits": logits})
    assert "task.top_k 3 is not below the 3 classes" in scan.problem(steps)


def test_a_replicate_that_gives_the_noise_floor_nothing_to_judge_by_is_refused_at_freeze():
    """The curve criterion bounds AMP's loss gap by ``loss_noise_multiple`` x the FP32 replicate's gap to the reference.
    A replicate identical to the reference (one update: no pair of updates to swap samples between) has a gap of 0,
    and 3 x 0 rolls back every trial whose loss moves at all; a replicate whose loss is not finite has an infinite gap,
    and 3 x inf passes any trial. Freeze refuses both in one line; an atol on the floor (``loss_noise_atol``) makes the
    identical replicate judge something, and without the noise criterion nothing depends on it."""
    shapes, rms = {"logits": (3,)}, {"logits": 3.0}
    ref = [step(i, 2.0 - 0.1 * i) for i in range(6)]

    def vet(replicate, acceptance=AcceptanceConfig()):
        return _vet(acceptance, "classification", shapes, rms, 0.95, "accuracy", True, ref, replicate=replicate)

    line = vet(list(ref))
    assert line is not None and "FP32 replicate repeats the reference's losses exactly over its 6 step(s)" in line, line
    assert "loss_noise_multiple: null" in line
    assert vet([step(i, r.loss + 0.01) for i, r in enumerate(ref)]) is None  # a real replicate
    assert vet(list(ref), AcceptanceConfig(loss_noise_atol=0.01)) is None
    assert vet(list(ref), AcceptanceConfig(loss_noise_multiple=None)) is None
    broken = [step(i, math.nan if i == 4 else r.loss + 0.01) for i, r in enumerate(ref)]
    line = vet(broken)
    assert line is not None and "the FP32 replicate's loss is not finite at step 4" in line, line
    assert vet(broken, AcceptanceConfig(loss_noise_multiple=None)) is None

    # And the verdict such a replicate would give, for the record: an inf floor accepts a trial 0.15 above FP32.
    off = [step(i, r.loss + 0.15) for i, r in enumerate(ref)]
    noise = trajectory_gap([r.loss for r in ref], [r.loss for r in off], 0.5, 0.1, [r.loss for r in broken], 3.0).noise
    assert noise.violations == 0 and math.isinf(noise.mean_replicate_gap)


def test_a_metric_that_is_not_finite_on_the_reference_is_named_as_such_not_as_missing_targets():
    """A user metric (R2 of constant targets) that returns NaN over cases that do carry targets: freeze refuses, and
    its line names the metric, not "no case of the fixed set carries a target", which sends the user looking for
    targets they gave."""
    steps = [step(i, 1.0) for i in range(4)]
    shapes, rms = {"output": (1,)}, {"output": 3.0}
    said = _vet(AcceptanceConfig(min_quality=None), "regression", shapes, rms, math.nan, "mymod:r2", True, steps,
                         with_target=True)
    assert said is not None and "quality (mymod:r2) is nan over the cases with a target" in said, said
    assert "no case of the fixed set carries" not in said
    none = _vet(AcceptanceConfig(min_quality=None), "regression", shapes, rms, math.nan, "mymod:r2", True, steps)
    assert none is not None and "no case of the fixed set carries a target" in none


@pytest.mark.parametrize("masked", [torch.finfo(torch.float32).min, -1e9, -math.inf])
def test_a_masked_class_does_not_put_every_case_near_the_boundary_under_relative_margins(masked):
    """``boundary_margin_kind: relative`` divides the top-2 margin by the spread of the row's scores. A class masked
    out (probability 0: ``finfo.min``, ``where(allowed, x, -1e9)``, -inf) is no score of the row: counted, it set the
    spread at 1e38 (or NaN), every margin at 0 and every case near the boundary, so that with
    ``max_near_boundary_flips: null`` a real flip far from the boundary was accepted. The margins are those of the
    live classes alone: the far flip rolls back, masked or not."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(200, 4, generator=g) * 2
    trial = scores.clone()
    far = int((scores.topk(2).values[:, 0] - scores.topk(2).values[:, 1]).argmax())  # the widest margin: far from any tie
    first, second = scores[far].topk(2).indices.tolist()
    trial[far, second] = scores[far, first] + 0.01  # one decision changed, far from the boundary
    y = scores.argmax(1)
    ids, every = [f"ordinary/s{i}" for i in range(200)], torch.ones(200, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, boundary_margin_kind="relative", boundary_margin=0.05, max_near_boundary_flips=None,
                              outputs={"*": Tolerance(atol=100.0, rtol=0.0)})
    with_mask = torch.cat([scores, torch.full((200, 1), masked)], 1)
    relative = [margins(s.topk(2), "relative", None, s) for s in (with_mask, scores)]
    assert torch.allclose(relative[0], relative[1], rtol=1e-12, atol=0)
    for ref, tri in ((scores, trial), (with_mask, torch.cat([trial, torch.full((200, 1), masked)], 1))):
        stats, d = _judge(ids, y, every, {"logits": ref}, {"logits": tri}, cfg=cfg)
        assert stats.flips.flips == 1 and stats.flips.near_boundary_cases < 200, stats.flips
        assert d.decision == "rollback" and any("away from the boundary" in r for r in d.reasons), d.reasons


def test_tie_is_flip_holds_for_a_one_logit_head_as_for_class_scores():
    """A sigmoid's logit that a float16 or bfloat16 trial rounds to exactly 0 (p = 0.5) ties its two classes. Under
    ``tie_rule: tie_is_flip`` a tie the reference lacks is a flip for class scores [N, 2]; the same head returned as
    one logit [N, 1] was decided by ``z >= 0`` alone, and its ties passed. Both forms now count the same flips; under
    ``lowest_index`` the one logit keeps its documented ``z >= 0``, and a tie on both sides is no flip."""
    g = torch.Generator().manual_seed(0)
    n = 300
    scores = torch.randn(n, 3, generator=g) * 3
    z = torch.randn(n, 1, generator=g) * 3
    z[:5] = torch.tensor([0.3, 0.2, 1.5, -0.4, 2.0]).unsqueeze(1)  # rounded to 0 by the trial: far from the boundary
    z[5] = 0.0
    tz = z.clone()
    tz[:6] = 0.0  # and case 5 ties on both sides
    y, ids, every = scores.argmax(1), [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    ties = dataclasses.replace(RULE, tie_rule="tie_is_flip", outputs={"*": Tolerance(atol=100.0, rtol=0.0)})
    pair = lambda v: torch.cat([torch.zeros_like(v), v], 1)  # noqa: E731 - the same decisions as two class scores
    one, _ = _judge(ids, y, every, {"logits": scores, "match_logit": z}, {"logits": scores, "match_logit": tz}, cfg=ties)
    two, _ = _judge(ids, y, every, {"logits": scores, "match_logits": pair(z)}, {"logits": scores, "match_logits": pair(tz)},
                    cfg=ties)
    counted = [(s.heads[h].flips, s.heads[h].near_boundary_flips) for s, h in ((one, "match_logit"), (two, "match_logits"))]
    assert counted[0] == counted[1] and sum(counted[0]) == 5, counted
    plain, _ = _judge(ids, y, every, {"logits": scores, "match_logit": z}, {"logits": scores, "match_logit": tz},
                      cfg=dataclasses.replace(ties, tie_rule="lowest_index"))
    assert plain.heads["match_logit"].real_flips == 1  # z = -0.4 to 0: class 0 to class 1; the others stay at class 1


def test_the_top_k_metric_ranks_equal_scores_by_class_not_by_topks_own_order():
    """Saturated scores (hardtanh at 6: several classes equal) with the target among them. ``topk`` keeps which of the
    equal ones its own way, and that depends on the other values of the row: a trial with the same saturated scores
    and the same decisions, its other scores moved by rounding, was counted hits lost and gained, and rolled back on
    quality. The target's rank now orders equal scores by class index (as ``lowest_index`` does): the same hits."""
    g = torch.Generator().manual_seed(8)
    n, classes = 600, 8
    scores = (torch.randn(n, classes, generator=g) * 10).clamp(-6.0, 6.0)
    trial = scores.clone()
    free = scores.abs() < 6.0
    trial[free] = (scores[free] + 0.01 * torch.randn(int(free.sum()), generator=g)).clamp(-5.99, 5.99)
    y = torch.randint(0, classes, (n,), generator=g)
    ties = (scores == 6.0).sum(1) >= 2
    assert int(ties.sum()) > 50
    for out in (scores, trial):
        q = QualityStats("top_k", "lowest_index", top_k=2)
        hit = q.update(out, y)
        saturated = out == 6.0
        above = (out > out.gather(1, y[:, None])).sum(1) + (saturated & (out == out.gather(1, y[:, None]))
                                                           & (torch.arange(classes) < y[:, None])).sum(1)
        assert torch.equal(hit[ties], (above < 2)[ties])
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, max_quality_drop=0.0, outputs={"*": Tolerance(atol=0.05, rtol=0.0)})
    stats, d = _judge(ids, y, every, {"logits": scores}, {"logits": trial}, cfg=cfg)
    assert stats.flips.real_flips == 0 and d.decision == "accept", d.reasons
    q_ref = QualityStats("top_k", "lowest_index", top_k=2)
    q_trial = QualityStats("top_k", "lowest_index", top_k=2)
    assert torch.equal(q_ref.update(scores, y), q_trial.update(trial, y))


def _bert(num_labels, head="sequence", seed=0):
    """A tiny Hugging Face BERT (random init) with its own head: ``sequence`` or ``token`` classification."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=num_labels)
    cls = transformers.BertForSequenceClassification if head == "sequence" else transformers.BertForTokenClassification
    return cls(config).eval()


def _bert_logits(num_labels, seed, scale=1.0, n=200):
    """A tiny BERT sequence classifier's logits over ``n`` random sentences, times ``scale`` (random init answers within
    0.04 of 0; a trained head's scale is larger): (the batch, the logits, a generator for the rest)."""
    model = _bert(num_labels)
    g = torch.Generator().manual_seed(seed)
    x = Batch(input_ids=torch.randint(1, 50, (n, 10), generator=g), attention_mask=torch.ones(n, 10, dtype=torch.long))
    with torch.no_grad():
        return x, scale * model(**x).logits, g


def _judged(kind, y, ref, trial, trained=None, cfg=RULE, mask=None, task=None):
    ids, every = [f"ordinary/s{i}" for i in range(len(y))], torch.ones(len(y), dtype=torch.bool)
    sources = streams.Sources(ids, y, every, streams.InMemory(ref), streams.InMemory(trial),
                              streams.InMemory(trained if trained is not None else trial), token_mask=mask)
    metric = streams.Metric.for_task(task or TaskConfig(kind=kind))
    stats, _ = streams.compare_streams(kind, cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0), metric=metric)
    return stats, rule.decide(stats, cfg)


def test_a_word_level_regression_ignores_the_targets_of_sub_words():
    """A word-level value (eye tracking, prosody) from Hugging Face's token head with one label: a value at each word's
    first sub-word, -100 at its continuations (real tokens) and at padding. Quality read the -100 targets as values, so
    an RMSE of ~50 hid an AMP-trained model 0.5 low at every word; and decided at 0 (labels 0 or 1), a crossing at a
    continuation sub-word, where no decision is read, rolled back a sound trial. Values are still judged at every real
    token; errors and decisions only where a target is."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    model = _bert(1, head="token")
    g = torch.Generator().manual_seed(1)
    n, t = 200, 12
    lengths = torch.randint(5, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 50, (n, t), generator=g) * mask
    x = Batch(input_ids=ids, attention_mask=mask)
    sub = (torch.rand(n, t, generator=g) < 0.3) & mask.bool()
    sub[:, 0] = False
    with torch.no_grad():
        ref = {"logits": model(**x).logits}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trial = {"logits": model(**x).logits.float()}
    value = ref["logits"][..., 0]
    y = (value + 0.05 * torch.randn(n, t, generator=g)).masked_fill(sub | ~mask.bool(), -100.0)
    words = y != -100
    rmse = float((value - y)[words].pow(2).mean().sqrt())
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.01)}, max_quality_drop=0.05)
    stats, d = _judged("regression", y, ref, trial, cfg=cfg, mask=mask)
    assert stats.quality.reference == pytest.approx(-rmse, rel=1e-6) and d.decision == "accept", d.reasons
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="mse"), acceptance=cfg)
    every = torch.ones(n, dtype=torch.bool)
    scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y, has_target=every))
    scan.update(0, ref)
    assert scan.quality.result() == pytest.approx(-rmse, rel=1e-6)
    low = {"logits": ref["logits"] - 0.5}  # an AMP-trained model 0.5 low at every word
    _, d = _judged("regression", y, ref, trial, trained=low, cfg=cfg, mask=mask)
    assert d.decision == "rollback" and any(r.startswith("quality after training") for r in d.reasons), d.reasons
    # the same head as a word tagger (labels 0 or 1 at words): decided at 0, at the words alone
    tags = (value > value[words].median()).float().masked_fill(sub | ~mask.bool(), -100.0)
    tagger = dataclasses.replace(cfg, max_quality_drop=None)
    for where, expected in ((sub, "accept"), (words, "rollback")):
        i, p = divmod(int((value.abs() + (~where) * 1e9).argmin()), t)  # the value nearest 0 there
        crossed = ref["logits"].clone()
        crossed[i, p, 0] = -0.001 * float(value[i, p].sign())
        stats, d = _judged("regression", tags, ref, {"logits": crossed}, cfg=tagger, mask=mask)
        assert d.decision == expected, (expected, d.reasons)
        assert stats.flips.real_flips == (expected == "rollback")
        assert stats.quality.metric == "label_accuracy" and set(stats.quality.paired) == {"trial", "trained"}  # the
        # paired bound of max_flip_rate, as for the same labels laid out [N, L]


def test_a_value_fitted_to_labels_by_mse_is_decided_at_their_midpoint():
    """Hugging Face's head of one label trains by MSE (``problem_type`` regression): fitted to labels 0 or 1, its value
    is decided at 0.5, and crossing 0 is no decision. Decided at 0 for its name, a sound bfloat16 trial rolled back for
    values a hair from 0. With several labels the head's loss is BCE: its logits are decided at 0, a crossing there
    rolls back. ``loss: mse`` fits values alike."""
    g = torch.Generator().manual_seed(2)
    n = 300
    x = Batch(input_ids=torch.randint(1, 50, (n, 10), generator=g), attention_mask=torch.ones(n, 10, dtype=torch.long))
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.0)}, max_quality_drop=None)
    for labels, loss, expected in ((1, "model", "accept"), (1, "mse", "accept"), (3, "model", "rollback")):
        model = _bert(labels)
        with torch.no_grad():
            ref = model(**x).logits
        y = (torch.rand(ref.shape, generator=g) < 0.5).float()
        row, col = divmod(int(ref.abs().argmin()), labels)  # the value nearest 0 crosses it, within atol
        trial = ref.clone()
        trial[row, col] = -0.001 * ref[row, col].sign()
        task = TaskConfig(kind="regression", loss=loss)
        stats, d = _judged("regression", y, {"logits": ref}, {"logits": trial}, cfg=cfg, task=task)
        assert d.decision == expected, (labels, loss, d.reasons)
        if expected == "accept":  # a crossing of 0.5 is the decision
            crossed = ref.clone()
            crossed[0, 0] = 0.5 + 0.01 if ref[0, 0] < 0.5 else 0.49
            cfg_wide = dataclasses.replace(cfg, outputs={"*": Tolerance(atol=1.0, rtol=0.0)})
            stats, d = _judged("regression", y, {"logits": ref}, {"logits": crossed}, cfg=cfg_wide, task=task)
            assert stats.flips.real_flips == 1 and d.decision == "rollback", (labels, loss, d.reasons)


def test_one_logit_under_the_models_own_loss_that_spreads_like_a_sigmoids_is_refused_until_told():
    """Under ``loss: model`` one value on labels 0 or 1 is read as Hugging Face's regression head (MSE, decided at 0.5);
    a model of one's own may train the same shape by BCE, its logit decided at 0. A reference spread as logits spread
    (most values far outside [-0.5, 1.5]) is refused at freeze in one line until ``acceptance.threshold`` says which;
    values within it (random init, or fitted) pass."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    x, raw, g = _bert_logits(1, seed=5)
    n = len(raw)
    y = (torch.rand(n, 1, generator=g) < 0.5).float()
    every = torch.ones(n, dtype=torch.bool)

    def refusal(ref, threshold=None):
        cfg = dataclasses.replace(RULE, threshold=threshold, max_quality_drop=None)
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="model"), acceptance=cfg)
        scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y, has_target=every))
        scan.update(0, {"logits": ref})
        return scan.problem(FLAT)

    logits = 200 * raw  # a confident BCE head's scale
    line = refusal(logits)
    assert line is not None and "acceptance.threshold" in line and "'logits'" in line and "\n" not in line
    assert refusal(logits, threshold=0.0) is None
    assert refusal(0.5 + 20 * raw) is None  # values fitted about 0.5 +- 0.4
    timid = 0.3 * (2 * y - 1) + 0.1 * torch.randn(n, 1, generator=g)  # a logit trained on noisy labels stays near 0:
    line = refusal(timid)  # within [-0.5, 1.5], but right at 0 and no better than a constant at 0.5
    assert line is not None and "acceptance.threshold" in line


def test_a_regression_flip_a_hair_from_its_threshold_is_near_the_boundary():
    """A multi-label head's logit 0.015 from 0 crosses it under autocast: as a single-logit head's, the flip is near the
    boundary (``boundary_margin``), which ``max_near_boundary_flips: null`` allows and 0 does not. A user's threshold
    is judged by the distance to it, in the output's units."""
    _, ref, _ = _bert_logits(4, seed=3, scale=50.0)
    y = (ref > 0).float()
    row, col = divmod(int(ref.abs().argmin()), 4)
    assert float(ref.abs().min()) < 0.05
    for threshold, shift in ((None, 0.0), (0.3, 0.3)):
        r = ref + shift
        trial = r.clone()
        trial[row, col] = 2 * shift - r[row, col]  # mirrored across the threshold
        base = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.1, rtol=0.0)}, threshold=threshold,
                                   max_quality_drop=None)
        for near, expected in ((None, "accept"), (0, "rollback")):
            stats, d = _judged("regression", y, {"logits": r}, {"logits": trial},
                               cfg=dataclasses.replace(base, max_near_boundary_flips=near))
            assert (stats.flips.near_boundary_flips, stats.flips.flips) == (1, 0), threshold
            assert d.decision == expected, (threshold, near, d.reasons)
        assert stats.flips.margin_kind == ("logit" if threshold is None else "value")
    far = ref.clone()
    i = int(ref[:, 0].abs().argmax())
    far[i, 0] = -ref[i, 0]
    stats, d = _judged("regression", y, {"logits": ref}, {"logits": far},
                       cfg=dataclasses.replace(RULE, outputs={"*": Tolerance(atol=10.0, rtol=0.0)}, max_quality_drop=None,
                                               max_near_boundary_flips=None))
    assert stats.flips.flips == 1 and d.decision == "rollback", d.reasons


def test_a_multi_label_model_is_scored_by_its_labels_not_by_the_rmse_of_its_logits():
    """The RMSE of logits against labels 0 or 1 points the wrong way: an AMP-trained multi-label model collapsed to
    0.5 everywhere scores better (0.5) than a confident sound one (~2), and was accepted. A regression decided at a
    threshold on labels is scored, under ``metric: auto``, by label accuracy; a ``min_quality`` given in -RMSE units
    is then refused at freeze, in one line."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    x, ref, g = _bert_logits(5, seed=4, scale=200.0)  # a confident model
    n = len(ref)
    y = (ref > 0).float()
    noise = torch.rand(y.shape, generator=g) < 0.05
    y[noise] = 1 - y[noise]
    collapsed = {"logits": torch.full_like(ref, 0.5)}
    stats, d = _judged("regression", y, {"logits": ref}, {"logits": ref}, trained=collapsed)
    assert stats.quality.metric == "label_accuracy" and stats.quality.reference > 0.9
    assert stats.quality.trained == pytest.approx(float(y.mean()))
    assert d.decision == "rollback" and any(r.startswith("quality after training") for r in d.reasons), d.reasons
    _, d = _judged("regression", y, {"logits": ref}, {"logits": ref})
    assert d.decision == "accept", d.reasons
    cfg = dataclasses.replace(RULE, min_quality=-1.0)
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="model"), acceptance=cfg)
    every = torch.ones(n, dtype=torch.bool)
    scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y, has_target=every))
    scan.update(0, {"logits": ref})
    problem = scan.problem(FLAT)
    assert problem is not None and "min_quality -1" in problem and "label_accuracy" in problem and "\n" not in problem


def test_a_value_per_position_without_a_mask_is_judged_where_its_targets_are_not_minus_100():
    """A per-token regression whose batch carries no ``attention_mask``: -100 targets are all that is known of its
    padding, as for a per-token classifier. Its -100 targets were scored as
    values (an RMSE of ~50 hid an AMP-trained model 0.5 off), and as [N, T, 1] the garbage a trial computes
    at padding, NaN under float16, was judged and rolled back a sound trial (and refused the reference at freeze). As
    [N, T, 1] its -100 targets mark padding, as for a per-token classifier."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    net, features, mask, g = _per_token_values(n=120)
    n = features.shape[0]
    real = mask.bool()
    with torch.no_grad():
        ref = net(features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trial = net(features).float()
    ref[~real], trial[~real] = float("nan"), float("nan")  # what padding holds, on both sides
    y = (ref.squeeze(-1) + 0.05 * torch.randn(ref.shape[:2], generator=g)).masked_fill(~real, -100.0)
    ids, every = [f"ordinary/s{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.2, rtol=0.0)}, max_quality_drop=0.05)
    rmse = -float((ref.squeeze(-1) - y)[real].pow(2).mean().sqrt())
    for squeeze in (False,):  # [N, T] without a mask is columns (test_columns_that_look_like_positions_are_columns)
        r, t = (v.squeeze(-1) if squeeze else v for v in (ref, trial))
        for trained, expected in ((t, "accept"), (r + 0.5, "rollback")):
            sources = streams.Sources(ids, y, every, streams.InMemory({"output": r}), streams.InMemory({"output": t}),
                                      streams.InMemory({"output": trained}))
            stats, _ = streams.compare_streams("regression", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0))
            d = rule.decide(stats, cfg)
            assert stats.values["output"].elements == int(real.sum()), squeeze
            assert stats.quality.reference == pytest.approx(rmse, rel=1e-6), squeeze
            assert d.decision == expected, (squeeze, expected, d.reasons)
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="mse"), acceptance=cfg)
        scan = vetting.Scan(params, Cases(ids=ids, x=features, y=y, has_target=every))
        scan.update(0, {"output": r})
        assert not bool(scan.nonfinite_rows(0, {"output": r}).any()), squeeze
        assert scan.quality.result() == pytest.approx(rmse, rel=1e-6), squeeze


def test_columns_that_look_like_positions_are_columns():
    """[N, D] with targets [N, D] cannot be told from T positions by its shape. A multi-label BERT of 8 labels over
    sentences of 8 tokens had its labels at padded positions dropped (the label of column 7 destroyed on every short
    sentence was accepted); readings of -100 dBm, without a mask, were ignored (NaN there was accepted). Labels that
    padding cannot hold (a 1) are columns, and without a mask an [N, D] output is columns: every value is judged."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=8,
                                     problem_type="multi_label_classification")
    model = transformers.BertForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(7)
    n, t = 300, 8
    lengths = torch.randint(4, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    x = Batch(input_ids=torch.randint(1, 50, (n, t), generator=g) * mask, attention_mask=mask)
    with torch.no_grad():
        ref = 200 * model(**x).logits
    y = (ref > 0).float()
    short = ~mask[:, -1].bool()
    trial = ref.clone()
    trial[short, 7] = -ref[short, 7]  # label 7 destroyed on every sentence whose last token is padding
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)})
    stats, d = _judged("regression", y, {"logits": ref}, {"logits": ref}, cfg=cfg, mask=mask)
    assert d.decision == "accept", d.reasons
    stats, d = _judged("regression", y, {"logits": ref}, {"logits": trial}, cfg=cfg, mask=mask)
    assert stats.flips.real_flips == int(short.sum()) and d.decision == "rollback", d.reasons
    # readings of -100 dBm are values: a NaN there is a non-finite output, an error of 40 dB is one
    dbm = -60 - 20 * torch.rand(n, 3, generator=g)
    dbm[:20, 1] = -100.0
    wrong = dbm.clone()
    wrong[5, 1] = float("nan")
    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.5, rtol=0.0)}, max_quality_drop=None)
    _, d = _judged("regression", dbm, {"output": dbm}, {"output": wrong}, trained={"output": wrong}, cfg=cfg)
    assert d.decision == "rollback" and any("non-finite" in r for r in d.reasons), d.reasons


def test_a_multi_label_heads_probabilities_beside_its_logits_are_not_judged_by_argmax():
    """A multi-label model returns its logits and their sigmoid, ``probs`` [N, L]. The labels are decided one by one on
    the primary; read as class scores, ``probs`` rolled a sound bfloat16 trial back for swaps of two labels at 0.986
    that both stay on. freeze asks, in one line, for ``probs: {decisions: false}``; so told, it passes."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    x, ref, g = _bert_logits(6, seed=8, scale=200.0)
    n = len(ref)
    y = (ref > 0).float()
    outputs = {"logits": ref, "probs": torch.sigmoid(ref)}
    every = torch.ones(n, dtype=torch.bool)

    def refusal(cfg):
        params = dataclasses.replace(config.Params(), task=TaskConfig(kind="regression", loss="model"), acceptance=cfg)
        scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y, has_target=every))
        scan.update(0, outputs)
        return scan.problem(FLAT)

    cfg = dataclasses.replace(RULE, outputs={"*": Tolerance(atol=0.05, rtol=0.02)}, max_quality_drop=None)
    line = refusal(cfg)
    assert line is not None and "'probs'" in line and "decisions: false" in line and "\n" not in line
    told = dataclasses.replace(cfg, outputs={"*": Tolerance(atol=0.05, rtol=0.02),
                                             "probs": Tolerance(atol=0.01, rtol=0.0, decisions=False)})
    assert refusal(told) is None


def test_a_healthy_large_batch_run_is_within_the_noise_floor_its_replicate_measures():
    """The FP32 replicate trains again on another data order, one sample traded per 64 of each pair of updates
    (``training.neighbours_swapped``). One sample whatever the batch shrank FP32's measured noise as 1/batch while a
    reduced precision's own gap stays: at 16,384 samples an update, a healthy bfloat16 run (its largest loss gap 1.5e-4
    nats) rolled back for being above 3x a replicate gap of 2e-5."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 32, generator=g) * 0.6
    y = torch.randint(0, 10, (16384 * 20,), generator=g)
    source = TensorSource(centres[y] + torch.randn(len(y), 32, generator=g), y)
    cfg = ReferenceConfig(train_steps=20, batch_size=16384, checkpoint_every=0)
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))

    def run(policy, batches=None):
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        model.load_state_dict(start.state_dict())
        return training.train(model, source, cfg, TaskConfig(), policy, torch.device("cpu"), 0, batches=batches).records

    order = training.update_batches(len(source), cfg, 0)
    assert sum(t.numel() for t in order[0]) == 16384
    reference, replicate = run(Policy()), run(Policy(), training.neighbours_swapped(order))
    trial = run(Policy(dtype="bfloat16"))
    runs = streams.Trajectories(tuple(reference), tuple(trial), 1.0, scaler_enabled=False, replicate=tuple(replicate))
    noise = streams.training_stats(AcceptanceConfig(), runs).noise
    assert noise.violations == 0 and noise.mean_amp_gap < 3 * noise.mean_replicate_gap, noise


def _freeze_refusal(kind, x, y, outputs, cfg=RULE):
    """What freeze's scan of the FP32 ``outputs`` refuses (``vetting.Scan.problem``), or None."""
    from pipeline import config, vetting
    from pipeline.cases import Cases

    n = len(y)
    params = dataclasses.replace(config.Params(), task=TaskConfig(kind=kind), acceptance=cfg)
    scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y,
                                      has_target=torch.ones(n, dtype=torch.bool)))
    scan.update(0, outputs)
    return scan.problem(FLAT)


def _classifier_with_a_head(n: int):
    """Inputs [n, 8] and a random init's body, 4-class classifier and second 3-column head (seed 0)."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return x, torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()), torch.nn.Linear(32, 4), torch.nn.Linear(32, 3)


def test_a_measurement_beside_a_classifier_is_refused_where_its_offset_makes_the_band_vacuous():
    """A classifier with a measurement head of its own, decided by default (named neither like scores nor like
    features): ``pressure`` [N] at 101340 Pa +- 30 (decided by its sign, always +) or ``size`` [N, 3] with a column at
    1e6 +- 3 (argmax: always that column). Under the default tolerance, rtol's band at the offset (2027 Pa) is far wider
    than the spread: a trial answering the mean everywhere was accepted, values and decisions alike. freeze refuses it in
    one line naming a tolerance below the spread; so told, it passes."""
    n = 400
    x, body, cls, meas = _classifier_with_a_head(n)
    with torch.no_grad():
        h = body(x)
        logits, m = 10 * cls(h), meas(h) / 0.5
    size = torch.stack([1e6 + 3 * m[:, 0], 5 + m[:, 1], 2 + 0.5 * m[:, 2]], 1)
    y = logits.argmax(1)
    for name, head in (("pressure", 101340.0 + 59.0 * m[:, 0]), ("pressure", 101340.0 + 59.0 * m[:, :1]), ("size", size)):
        ref = {"logits": logits, name: head}
        line = _freeze_refusal("classification", x, y, ref)
        assert line is not None and f"'{name}'" in line and "spread" in line and "\n" not in line, line
        assert ("column 0" in line) == (name == "size"), line
        flat = head.clone()
        flat[..., 0] = head[..., 0].mean()  # its offset column answers one value for every case
        trial = {"logits": logits, name: flat if head.ndim == 2 else torch.full_like(head, float(head.mean()))}
        _, d = _judged("classification", y, ref, trial)
        assert d.decision == "accept"  # what freeze's refusal keeps from ever being judged
        told = dataclasses.replace(RULE, outputs={"*": Tolerance(), name: Tolerance(atol=0.3, rtol=0.0)})
        assert _freeze_refusal("classification", x, y, ref, told) is None
        _, d = _judged("classification", y, ref, trial, cfg=told)
        assert d.decision == "rollback", d.reasons


def test_a_random_init_second_head_of_a_bert_is_not_refused_for_its_small_spread():
    """The other side of the offset vetting (``vetting.Scan.pinned_offset``): a tiny random-init BERT with two heads of
    its own. ``intent`` [N, 5] spreads less than 0.05 = atol, its means up to 0.2 from torch's bias init: at seed 12 its
    argmax is class 3 for every case, pinned, but no offset makes its band vacuous (rtol x |mean| below every column's
    spread), so its values still bound it. ``topic``, a softmax at 1 / classes (0.25 +- 0.002), is vacuous by its offset,
    but its argmax varies: its decisions judge it (no softmax is exempt: a dominant column pinning argmax is refused).
    freeze takes them, and a real float16 trial of the logits and intent is accepted."""
    transformers = pytest.importorskip("transformers")

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, max_position_embeddings=32, num_labels=3)
            self.bert = transformers.BertForSequenceClassification(config)
            self.intent, self.topic = torch.nn.Linear(32, 5), torch.nn.Linear(32, 4)
            self.bert._init_weights(self.topic)  # Hugging Face's init: std 0.02, bias 0

        def forward(self, input_ids, attention_mask):
            out = self.bert.bert(input_ids=input_ids, attention_mask=attention_mask)
            return {"logits": self.bert.classifier(out.pooler_output), "intent": self.intent(out.pooler_output),
                    "topic": self.topic(out.pooler_output).softmax(-1)}

    for seed in (0, 12):
        torch.manual_seed(seed)
        model = TwoHeads().eval()
        with torch.no_grad():
            model.bert.classifier.weight.mul_(100.0)  # the primary at a trained head's scale (freeze takes no RMS of 0.01)
        g = torch.Generator().manual_seed(seed)
        n = 200
        x = Batch(input_ids=torch.randint(1, 60, (n, 12), generator=g), attention_mask=torch.ones(n, 12, dtype=torch.long))
        ref = inference.infer(model, x, Policy(dtype="float32"), torch.device("cpu"), eval_mode=True)
        trial = inference.infer(model, x, Policy(dtype="float16"), torch.device("cpu"), eval_mode=True)
        assert float(ref["intent"].std(0).max()) < 0.05
        assert float(ref["topic"].std(0).max()) < 0.02 * 0.25  # a softmax's 1/4 +- less than rtol x its mean
        assert len(ref["topic"].argmax(1).unique()) > 1  # ... but its argmax varies: no pinned decision
        intent = ref["intent"]
        assert bool((0.02 * intent.mean(0).abs() < intent.std(0, unbiased=False)).all())  # no column vacuous by its offset
        assert (len(intent.argmax(1).unique()) == 1) == (seed == 12)  # pinned at seed 12, taken all the same
        y = ref["logits"].argmax(1)
        assert _freeze_refusal("classification", x, y, ref) is None
        two = ("logits", "intent")  # (topic's margins of 1e-3 flip under float16, as they should)
        _, d = _judged("classification", y, {k: ref[k] for k in two}, {k: trial[k] for k in two})
        assert d.decision == "accept", (seed, d.reasons)


def test_a_common_offset_head_whose_argmax_varies_is_judged_by_its_decisions_not_refused():
    """Q-values beside the logits: ``q_values`` [N, 4] = V(s) + A(s, a), V at 50 +- 0.5 common to every action, the
    actions' small differences deciding the argmax. rtol's band at 50 (1.0) covers each column's spread, yet a trial
    answering each column's mean changes the chosen action wherever the reference's differs: its decisions roll it back.
    freeze refused it as vacuous (4e8ff39), and its fix, an atol below the spread, rolled back mere bfloat16 rounding
    (0.125 at 50: reviewer's probe p7). Only a pinned decision with a vacuous band is refused."""
    g = torch.Generator().manual_seed(0)
    n = 400
    x = torch.randn(n, 8, generator=g)
    torch.manual_seed(0)
    body, cls = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()), torch.nn.Linear(32, 4)
    value, advantage = torch.nn.Linear(32, 1), torch.nn.Linear(32, 4)
    with torch.no_grad():
        h = body(x)
        logits, v, a = 10 * cls(h), value(h), advantage(h)
        q = 50 + 0.5 * v / v.std() + 0.3 * (a - a.mean(1, keepdim=True)) / a.std()
    y = logits.argmax(1)
    ref = {"logits": logits, "q_values": q}
    assert bool((0.02 * q.mean(0).abs() >= q.std(0)).all())  # the band at the offset covers every column's spread
    assert len(q.argmax(1).unique()) > 1  # the actions' differences decide: three actions chosen
    assert _freeze_refusal("classification", x, y, ref) is None
    means = {"logits": logits, "q_values": q.mean(0, keepdim=True).expand(n, 4).clone()}
    _, d = _judged("classification", y, ref, means)
    assert d.decision == "rollback" and any(r.startswith("decisions 'q_values'") for r in d.reasons), d.reasons


def test_a_softmax_head_whose_dominant_column_pins_its_argmax_is_refused_where_its_offset_makes_the_band_vacuous():
    """A trained softmax head beside the logits, ``mix`` [N, 3], its first column 0.954 +- 0.002: argmax 0 for every
    case, and rtol's band at 0.954 (0.019) far wider than the spread. A trial answering the mean for every case passed
    its values and its decisions and was accepted, a833c69 having exempted every softmax (its reason, 1 / classes, holds
    for a random init's near-uniform head, whose argmax varies: reviewer's probe p11). freeze refuses it in one line
    saying why and giving a tolerance below the spread; so told, it passes, and that trial rolls back."""
    import re

    n = 400
    x, body, cls, head = _classifier_with_a_head(n)
    with torch.no_grad():
        head.weight.mul_(0.1)
        head.bias.copy_(torch.tensor([4.0, 0.5, 0.0]))
        h = body(x)
        logits, mix = 10 * cls(h), head(h).softmax(-1)
    y = logits.argmax(1)
    ref = {"logits": logits, "mix": mix}
    assert bool((mix.argmax(1) == 0).all()) and 0.02 * float(mix[:, 0].mean()) >= float(mix[:, 0].std())
    line = _freeze_refusal("classification", x, y, ref)
    assert line is not None and "\n" not in line, line
    assert "'mix'" in line and "the same for every case" in line and "spread" in line and "decisions: false" in line, line
    means = {"logits": logits, "mix": mix.mean(0, keepdim=True).expand(n, 3).clone()}
    _, d = _judged("classification", y, ref, means)
    assert d.decision == "accept"  # what freeze's refusal keeps from ever being judged
    atol = float(re.search(r"\{atol: ([0-9.e-]+), rtol: 0\}", line).group(1))
    assert 0 < atol < float(mix.std(0).min())
    for said in (None, False):  # the fix it names, a decision or not
        told = dataclasses.replace(RULE, outputs={"*": Tolerance(), "mix": Tolerance(atol=atol, rtol=0.0, decisions=said)})
        assert _freeze_refusal("classification", x, y, ref, told) is None
        _, d = _judged("classification", y, ref, means, cfg=told)
        assert d.decision == "rollback", d.reasons


def _qa(seed, n=300, t=16):
    """A tiny random-init BertForQuestionAnswering (its head x30: scores of a trained one's spread) over right-padded
    contexts of 5 to ``t`` tokens: the batch, the FP32 and the real bfloat16 autocast outputs, the mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = transformers.BertForQuestionAnswering(config).eval()
    with torch.no_grad():
        model.qa_outputs.weight.mul_(30.0)
    g = torch.Generator().manual_seed(seed + 100)
    lengths = torch.randint(5, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    x = Batch(input_ids=torch.randint(1, 60, (n, t), generator=g) * mask, attention_mask=mask)
    ref, trial = (inference.infer(model, x, Policy(dtype=dtype), torch.device("cpu"), eval_mode=True)
                  for dtype in ("float32", "bfloat16"))
    return x, ref, trial, mask


def test_an_extractive_qa_head_is_decided_among_the_real_tokens():
    """start_logits / end_logits [N, T] of a right-padded QA model against one answer position per case: the answer's
    boundary is read among the real tokens (Hugging Face's QA pipeline masks padding). Argmaxed over every position, a
    sound bfloat16 trial rolled back for 5 "flips" whose FP32 argmax was a padding position (seed 5), and one that moved
    the answer's end of 2 cases among the real tokens was accepted, the argmax staying on padding (seed 8). Freeze and
    compare read padding at -inf alike: a NaN there is no fault, and the reference's accuracy is over real tokens."""
    from pipeline import task

    for seed, expected, flipped in ((5, "accept", []), (8, "rollback", ["ordinary/s112", "ordinary/s294"])):
        x, ref, trial, mask = _qa(seed)
        real = mask.bool()
        y = ref["end_logits"].masked_fill(~real, -1e9).argmax(1)  # the answers the FP32 model gives
        assert bool((ref["end_logits"].argmax(1) != y).any())  # some FP32 argmax over every position is padding
        stats, d = _judged("classification", y, ref, trial, mask=mask)
        assert d.decision == expected, (seed, d.reasons)
        assert [f.id for f in stats.flips.flip_list] + [f.id for f in stats.heads["start_logits"].flip_list] == flipped
        assert torch.equal(task.scores_over_positions(tuple(ref["end_logits"].shape), y, torch.ones(len(y), dtype=torch.bool),
                                                      mask), real)
        assert stats.quality.reference == 1.0
        assert _freeze_refusal("classification", x, y, ref) is None
    holes = {name: v.masked_fill(~real & (torch.arange(v.shape[1]) == v.shape[1] - 1), math.nan) for name, v in trial.items()}
    _, d = _judged("classification", y, ref, holes, mask=mask)  # NaN at padding: no output the application reads
    assert d.decision == "rollback" and not any("finite" in r for r in d.reasons), d.reasons
    from pipeline import config, vetting
    from pipeline.cases import Cases

    params = dataclasses.replace(config.Params(), task=TaskConfig(), acceptance=RULE)
    scan = vetting.Scan(params, Cases(ids=[f"ordinary/s{i}" for i in range(len(y))], x=x, y=y,
                                      has_target=torch.ones(len(y), dtype=torch.bool)))
    assert not bool(scan.nonfinite_rows(0, holes).any())
    scan.update(0, ref)
    assert scan.quality.result() == 1.0


def test_scores_over_classes_of_the_sequences_length_stay_classes():
    """What reads scores over positions and what does not: a sequence classifier whose classes happen to be as many as
    the padded length (16 intents, max_length 16) has labels past a short case's last token, and keeps every class: a
    trial moving a short case to such a class flips. Per-token scores [N, T, C], a value per position [N, T] against
    targets [N, T], no mask, no padding, or padding only in cases without a target are not read over positions either."""
    from pipeline import task

    t, n = 16, 300
    x, ref, _ = _bert_logits(t, seed=3, scale=200.0, n=n)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    x = Batch(input_ids=x["input_ids"][:, :1].expand(n, t) * mask, attention_mask=mask)  # the batch's mask is [N, 16]
    y = ref.argmax(1)
    every = torch.ones(n, dtype=torch.bool)
    assert bool((y >= lengths).any())
    assert task.scores_over_positions((n, t), y, every, mask) is None
    short = int(torch.nonzero(lengths < t - 1)[0])
    trial = ref.clone()
    trial[short, t - 1] = ref[short].max() + 1.0  # a class past that case's last real token
    stats, d = _judged("classification", y, {"logits": ref}, {"logits": trial}, mask=mask)
    assert [f.id for f in stats.flips.flip_list] == [f"ordinary/s{short}"] and d.decision == "rollback", d.reasons
    assert task.scores_over_positions((n, t, 3), y, every, mask) is None  # per token
    assert task.scores_over_positions((n, t), y[:, None].expand(n, t), every, mask) is None  # targets [N, T]
    assert task.scores_over_positions((n, t), y % 4, every, None) is None  # no mask
    assert task.scores_over_positions((n, t), y % 4, every, torch.ones(n, t)) is None  # no padding
    assert task.scores_over_positions((n, t), y % 4, every & (lengths == t), mask) is None  # no padded case has a target
    assert task.scores_over_positions((n, t), y % 4, every, mask) is not None  # every answer at a real position


def test_a_stated_loss_band_that_fp32_fails_against_its_own_replicate_is_refused_at_freeze():
    """Issue 48: two trainings that differ in rounding decorrelate, as two FP32 runs on another data order do. A fixed
    per-step band that FP32's own replicate leaves cannot tell precision from noise: freeze refuses it in one line that
    names how often FP32 fails it and the atol FP32 passes. A band FP32 stays inside is kept; the default (no fixed
    band) leaves the curve to the noise floor, and a trial outside a band nobody stated is not rolled back for it."""
    shapes, rms = {"logits": (3,)}, {"logits": 3.0}
    ref = [step(i, 1.0 - 0.01 * i) for i in range(40)]
    # Decorrelated from step 10 on: the replicate wanders +-0.08 around the reference.
    replicate = [step(i, r.loss + (0.08 if i % 3 == 0 else -0.06) * (i >= 10)) for i, r in enumerate(ref)]
    stated = AcceptanceConfig(loss_atol=0.05, loss_rtol=0.0)

    def vet(acceptance, rep=replicate):
        return _vet(acceptance, "classification", shapes, rms, 0.95, "accuracy", True, ref, replicate=rep)

    line = vet(stated)
    assert line is not None and "FP32's own replicate (another data order) leaves this per-step band at 30 of 40 steps" in line
    assert "first at step 10" in line and "loss_atol >= 0.08 at loss_rtol 0" in line, line
    assert vet(AcceptanceConfig(loss_atol=0.08, loss_rtol=0.0)) is None  # what FP32 itself passes
    assert vet(AcceptanceConfig()) is None  # the default: no fixed band
    assert "reference.replicates: 2" in vet(stated, rep=None)  # a stated band with nothing to calibrate it on

    # The verdict: with no fixed band, a gap of 0.07 at every step is the noise floor's to judge, not a band's.
    trial = [r.loss + 0.07 for r in ref]
    gap = trajectory_gap([r.loss for r in ref], trial, None, None, [r.loss for r in replicate], 3.0)
    assert gap.band_violations == 0 and gap.noise is not None and gap.noise.violations == 0
    stated_gap = trajectory_gap([r.loss for r in ref], trial, 0.05, 0.0, [r.loss for r in replicate], 3.0)
    assert stated_gap.band_violations == 40


def test_a_minimum_quality_fp32_misses_after_training_again_is_refused_at_freeze():
    """The A/A of ``min_quality``: FP32 trained again on another data order reaches 0.86 where the reference reached
    0.92; a minimum of 0.9 would roll back FP32 itself, so freeze refuses it in one line with the value FP32 meets. A
    minimum both FP32 runs meet is kept."""
    from pipeline.artifacts.comparison import FP32Spread

    shapes, rms = {"logits": (3,)}, {"logits": 3.0}
    ref = [step(i, 1.0 - 0.01 * i) for i in range(8)]
    rep = [step(i, r.loss + 0.01) for i, r in enumerate(ref)]
    spread = FP32Spread(metric="accuracy", reference=0.92, replicates=(0.86,))

    def vet(minimum):
        return _vet(AcceptanceConfig(min_quality=minimum), "classification", shapes, rms, 0.92, "accuracy", True,
                             ref, replicate=rep, spread=spread)

    line = vet(0.9)
    assert line is not None and "FP32's own replicate (trained again on another data order) reaches accuracy 0.86" in line
    assert "beyond 0.86" in line, line
    assert vet(0.8) is None and vet(None) is None


def test_a_noise_floor_fp32_itself_fails_is_widened_to_what_fp32_needs_and_said():
    """The A/A of ``loss_noise_multiple``: with two replicates or more, each replicate's mean gap is read against the
    others'. Gaps of 0.01 and 0.05 (5x apart, as the overflow example's two replicates were at 12 updates) would roll FP32
    itself back at a multiple of 3: the floor takes FP32's own 5x, and the verdict says the rule's 3x was widened. A trial
    4x the replicates' mean passes it; 7x still fails. Replicates that agree leave the rule's multiple as it is."""
    ref = [1.0 - 0.01 * i for i in range(20)]

    def moved(by, base=ref):
        return [r + (by if i % 2 else -by) for i, r in enumerate(base)]

    calm = trajectory_gap(ref, moved(0.03), None, None, moved(0.01), 3.0, more_replicates=[moved(0.05)]).noise
    assert calm.multiple == pytest.approx(5.0) and calm.stated_multiple == 3.0 and calm.violations == 0
    far = trajectory_gap(ref, moved(0.21), None, None, moved(0.01), 3.0, more_replicates=[moved(0.05)]).noise
    assert far.violations > 0 and "mean" in far.over
    agree = trajectory_gap(ref, moved(0.03), None, None, moved(0.01), 3.0, more_replicates=[moved(0.02)]).noise
    assert agree.multiple == 3.0 and agree.stated_multiple is None
    out = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    sources = streams.Sources([f"ordinary/{i}" for i in range(8)], out.argmax(1), torch.ones(8, dtype=torch.bool),
                              *(streams.InMemory({"output": out}) for _ in range(3)))
    runs = [[step(i, v) for i, v in enumerate(losses)] for losses in (ref, moved(0.03), moved(0.01), moved(0.05))]
    stats, _ = streams.compare_streams("classification", AcceptanceConfig(min_quality=None), sources, streams.Trajectories(
        runs[0], runs[1], 1.0, scaler_enabled=False, replicate=runs[2], more_replicates=(runs[3],)))
    d = rule.decide(stats, AcceptanceConfig(min_quality=None))
    assert any("the rule's 3x, widened: FP32's replicates differ by that much among themselves" in c for c in d.checks)
    assert _vet(AcceptanceConfig(), "classification", {"logits": (3,)}, {"logits": 3.0}, 0.95, "accuracy", True,
                         [step(i, v) for i, v in enumerate(ref)], replicate=[step(i, v) for i, v in enumerate(moved(0.01))],
                         more_replicates=[[step(i, v) for i, v in enumerate(moved(0.05))]]) is None
