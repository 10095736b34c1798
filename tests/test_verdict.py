"""The rule applied to statistics: every criterion can fail on its own, and loosened rules are visible."""

import copy
import dataclasses

import pytest

from pipeline import rule
from pipeline.config import AcceptanceConfig, Tolerance


def healthy_stats():
    gap = {"nonfinite_trial_only": 0, "failing": 0, "elements": 100, "failing_fraction": 0.0, "atol": 0.05, "rtol": 0.02,
           "max_abs": 0.01, "min_passing_atol": 0.0, "per_kind": {}}
    return {
        "values": {"output": gap},
        "flips": {"flips": 0, "boundary_flips": 1, "boundary_cases": 4, "boundary_flip_fraction": 0.25, "flip_list": []},
        "quality": {"metric": "accuracy", "reference": 0.95, "trial": 0.95, "trained": 0.945},
        "training": {"first_nonfinite_loss_step": -1, "band_violations": 0, "max_loss_gap": 0.01, "max_loss_gap_step": 3,
                     "steps": 60, "first_violation_step": -1, "skipped_steps": 2, "skipped_fraction": 2 / 60, "stalled": False,
                     "final_scale": 32768.0,
                     "noise": {"violations": 0, "first_violation_step": -1, "mean_amp_gap": 0.004, "mean_replicate_gap": 0.008,
                               "max_amp_gap": 0.01, "max_replicate_gap": 0.03}},
    }


RULE = AcceptanceConfig(min_quality=0.9)


def test_healthy_trial_is_accepted_with_checks_listed():
    d = rule.decide(healthy_stats(), RULE)
    assert d["decision"] == "accept" and d["reasons"] == []
    assert len(d["checks"]) >= 10


@pytest.mark.parametrize(
    "path,value,word",
    [
        (("values", "output", "nonfinite_trial_only"), 3, "non-finite"),
        (("values", "output", "failing_fraction"), 0.01, "outside atol"),
        (("flips", "flips"), 1, "flip(s) among real cases away from the boundary"),
        (("quality", "trial"), 0.93, "drop"),
        (("quality", "trained"), 0.85, "below minimum"),
        (("training", "first_nonfinite_loss_step"), 7, "loss not finite from step 7"),
        (("training", "band_violations"), 4, "outside band"),
        (("training", "skipped_fraction"), 0.5, "skipped"),
        (("training", "stalled"), True, "stopped advancing"),
        (("training", "final_scale"), 0.5, "loss scale fell"),
    ],
)
def test_each_criterion_alone_rolls_back(path, value, word):
    stats = healthy_stats()
    node = stats
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    d = rule.decide(stats, RULE, findings=["culprit: layer 2"])
    assert d["decision"] == "rollback"
    assert any(word in r for r in d["reasons"]), d["reasons"]
    assert "diagnosis: culprit: layer 2" in d["reasons"]


def test_boundary_flip_limit_is_separate():
    stats = healthy_stats()
    strict = dataclasses.replace(RULE, max_boundary_flip_fraction=0.2)
    assert rule.decide(stats, strict)["decision"] == "rollback"
    assert rule.decide(stats, RULE)["decision"] == "accept"


def rule_dict(**kw):
    return dataclasses.asdict(dataclasses.replace(RULE, **kw))


def test_loosened_lists_every_widened_criterion():
    old = rule_dict()
    new = rule_dict(outputs={"*": Tolerance(atol=0.1, rtol=0.02)}, max_flips=2, min_quality=0.8, max_quality_drop=0.0)
    diff = rule.loosened(old, new)
    assert "outputs.*.atol 0.05 -> 0.1" in diff
    assert "max_flips 0 -> 2" in diff and "min_quality 0.9 -> 0.8" in diff
    assert not any("max_quality_drop" in d for d in diff)  # tightened, not loosened
    assert rule.loosened(old, old) == []
    assert rule.loosened(new, old) != []  # and the other way round only the tightened one shows
    assert rule.loosened(rule_dict(tie_rule="tie_is_flip"), rule_dict()) == ["tie_rule tie_is_flip -> lowest_index"]


def test_accept_under_a_looser_rule_than_an_earlier_rollback_is_flagged():
    strict = rule_dict()
    loose = rule_dict(outputs={"*": Tolerance(atol=0.5, rtol=0.02)})
    accepted = rule.decide(healthy_stats(), RULE)
    flagged = rule.flag_loosened_rule(copy.deepcopy(accepted), loose, [{"rule": strict, "rule_sha256": "a" * 64}])
    assert flagged["decision"] == "accept"
    assert flagged["tags"]["rule_loosened"] == "true"
    assert any("looser" in r and "outputs.*.atol" in r for r in flagged["reasons"])
    same = rule.flag_loosened_rule(copy.deepcopy(accepted), strict, [{"rule": strict, "rule_sha256": "a" * 64}])
    assert same["reasons"] == [] and "tags" not in same


def test_every_numeric_criterion_has_a_direction():
    """A new criterion in AcceptanceConfig must say which way is looser, or loosening it would go unflagged."""
    fields = {f.name for f in dataclasses.fields(AcceptanceConfig)}
    assert set(rule._LOOSER_WHEN) | set(rule._COMPARED_APART) == fields
    assert not set(rule._LOOSER_WHEN) & set(rule._COMPARED_APART)
    for name in rule._LOOSER_WHEN:  # each loosening step is seen, from a set value
        base = {"outputs": {}, name: 0.5}
        looser = {"outputs": {}, name: 0.5 + rule._LOOSER_WHEN[name]}
        assert rule.loosened(base, looser) == [f"{name} 0.5 -> {0.5 + rule._LOOSER_WHEN[name]:g}"]
        assert rule.loosened(base, {"outputs": {}, name: None}) == [f"{name} removed (was 0.5)"]
        assert rule.loosened(looser, base) == []


def test_real_flips_near_the_boundary_fail_by_default_and_an_explicit_null_is_said_in_words():
    stats = healthy_stats()
    stats["flips"].update({"near_boundary_flips": 1, "near_boundary_cases": 3, "margin_kind": "probability",
                           "flip_list": [{"id": "ordinary/digits-1274", "boundary": False, "near_boundary": True}]})
    d = rule.decide(stats, RULE)  # the shipped rule: every flip of a real sample counts against it
    assert d["decision"] == "rollback" and d["inference"] == "rollback" and d["training"] == "accept"
    assert any("ordinary/digits-1274" in r and "near the boundary" in r for r in d["reasons"])
    assert d["cases"]["flips"] == ["ordinary/digits-1274"]
    d = rule.decide(stats, dataclasses.replace(RULE, max_near_boundary_flips=None))
    assert d["decision"] == "accept"
    assert any("ordinary/digits-1274" in c and "not limited: the rule sets max_near_boundary_flips: null" in c for c in d["checks"])


def test_distribution_criteria():
    stats = healthy_stats()
    stats["distribution"] = {"tokens": 1000, "kl_mean": 1e-3, "kl_p99": 2e-2, "kl_max": 0.3, "top1_agreement": 0.995, "top_k_overlap": 0.98}
    assert rule.decide(stats, RULE)["decision"] == "accept"  # null criteria: not applied
    ok = dataclasses.replace(RULE, max_kl_mean=1e-2, max_kl_p99=0.05, min_top1_agreement=0.99)
    assert rule.decide(stats, ok)["decision"] == "accept"
    for strict, word in ((dict(max_kl_mean=1e-4), "KL(reference || trial) mean"), (dict(max_kl_p99=1e-2), "p99"),
                         (dict(min_top1_agreement=0.999), "top-1 agreement")):
        d = rule.decide(stats, dataclasses.replace(RULE, **strict))
        assert d["decision"] == "rollback" and any(word in r for r in d["reasons"]), d["reasons"]
    del stats["distribution"]
    d = rule.decide(stats, ok)
    assert d["decision"] == "rollback" and any("per-token" in r for r in d["reasons"])


def test_noise_floor_criterion():
    stats = healthy_stats()
    stats["training"]["noise"] = {"violations": 2, "over": ["mean", "max"], "first_violation_step": 5, "mean_amp_gap": 0.02,
                                  "mean_replicate_gap": 0.001, "max_amp_gap": 0.05, "max_replicate_gap": 0.004}
    assert rule.decide(stats, dataclasses.replace(RULE, loss_noise_multiple=None))["decision"] == "accept"
    d = rule.decide(stats, dataclasses.replace(RULE, loss_noise_multiple=3.0, loss_noise_atol=0.0))
    assert d["decision"] == "rollback" and any("noise floor" in r and "step 5" in r and "mean and max" in r for r in d["reasons"])
    del stats["training"]["noise"]
    d = rule.decide(stats, dataclasses.replace(RULE, loss_noise_multiple=3.0))
    assert any("replicate" in r for r in d["reasons"])


def test_quality_drop_follows_the_metric_direction():
    stats = healthy_stats()
    stats["quality"] = {"metric": "perplexity", "higher_is_better": False, "reference": 10.0, "trial": 10.005, "trained": 10.0}
    assert rule.decide(stats, AcceptanceConfig())["decision"] == "accept"
    stats["quality"]["trial"] = 10.5
    d = rule.decide(stats, AcceptanceConfig())
    assert d["decision"] == "rollback" and any("drop 0.5" in r for r in d["reasons"])


def test_no_target_in_the_fixed_set_is_a_named_reason_unless_the_rule_drops_quality():
    stats = healthy_stats()
    for key in ("reference", "trial", "trained"):
        stats["quality"][key] = float("nan")
    result = rule.decide(stats, AcceptanceConfig())
    assert result["decision"] == "rollback" and any("no case of the fixed set carries a target" in r for r in result["reasons"])
    result = rule.decide(stats, AcceptanceConfig(max_quality_drop=None, min_quality=None))
    assert result["decision"] == "accept", result["reasons"]
    assert any("not judged" in c for c in result["checks"])
    stats["quality"]["reference"] = 0.9  # a reference that has a quality and a trial that lost it: a failure
    assert rule.decide(stats, AcceptanceConfig())["decision"] == "rollback"
