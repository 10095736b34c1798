"""The rule applied to statistics: every criterion can fail on its own, and loosened rules are visible."""

import copy
import dataclasses

import pytest

from pipeline import verdict
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
                     "final_scale": 32768.0},
    }


RULE = AcceptanceConfig(min_quality=0.9)


def test_healthy_trial_is_accepted_with_checks_listed():
    d = verdict.decide(healthy_stats(), RULE)
    assert d["decision"] == "accept" and d["reasons"] == []
    assert len(d["checks"]) >= 10


@pytest.mark.parametrize(
    "path,value,word",
    [
        (("values", "output", "nonfinite_trial_only"), 3, "non-finite"),
        (("values", "output", "failing_fraction"), 0.01, "outside atol"),
        (("flips", "flips"), 1, "flip(s) among non-boundary"),
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
    d = verdict.decide(stats, RULE, findings=["culprit: layer 2"])
    assert d["decision"] == "rollback"
    assert any(word in r for r in d["reasons"]), d["reasons"]
    assert "diagnosis: culprit: layer 2" in d["reasons"]


def test_boundary_flip_limit_is_separate():
    stats = healthy_stats()
    strict = dataclasses.replace(RULE, max_boundary_flip_fraction=0.2)
    assert verdict.decide(stats, strict)["decision"] == "rollback"
    assert verdict.decide(stats, RULE)["decision"] == "accept"


def rule_dict(**kw):
    return dataclasses.asdict(dataclasses.replace(RULE, **kw))


def test_loosened_lists_every_widened_criterion():
    old = rule_dict()
    new = rule_dict(outputs={"*": Tolerance(atol=0.1, rtol=0.02)}, max_flips=2, min_quality=0.8, max_quality_drop=0.0)
    diff = verdict.loosened(old, new)
    assert "outputs.*.atol 0.05 -> 0.1" in diff
    assert "max_flips 0 -> 2" in diff and "min_quality 0.9 -> 0.8" in diff
    assert not any("max_quality_drop" in d for d in diff)  # tightened, not loosened
    assert verdict.loosened(old, old) == []
    assert verdict.loosened(new, old) != []  # and the other way round only the tightened one shows
    assert verdict.loosened(rule_dict(tie_rule="tie_is_flip"), rule_dict()) == ["tie_rule tie_is_flip -> lowest_index"]


def test_accept_under_a_looser_rule_than_an_earlier_rollback_is_flagged():
    strict = rule_dict()
    loose = rule_dict(outputs={"*": Tolerance(atol=0.5, rtol=0.02)})
    accepted = verdict.decide(healthy_stats(), RULE)
    flagged = verdict.flag_loosened_rule(copy.deepcopy(accepted), loose, [{"rule": strict, "rule_sha256": "a" * 64}])
    assert flagged["decision"] == "accept"
    assert flagged["tags"]["rule_loosened"] == "true"
    assert any("looser" in r and "outputs.*.atol" in r for r in flagged["reasons"])
    same = verdict.flag_loosened_rule(copy.deepcopy(accepted), strict, [{"rule": strict, "rule_sha256": "a" * 64}])
    assert same["reasons"] == [] and "tags" not in same
