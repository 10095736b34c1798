"""The compare artifact (pipeline/artifacts/comparison.py): compare's typed statistics written as stats.json and read back,
section by section, key for key."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from pipeline import paths
from pipeline.artifacts import comparison
from pipeline.artifacts.comparison import Stats
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig, Tolerance
from pipeline.errors import UserError
from pipeline.files import dumps, from_jsonable
from _steps import step

STEPS = [step(i, 1.0 / (i + 1), skipped=i == 3, scale=2.0**16) for i in range(12)]
REPLICATE = [dataclasses.replace(s, loss=s.loss * 1.01) for s in STEPS]


def _compare(kind, ids, y, has, ref, trial, trained=None, fp64=None, rule=AcceptanceConfig(), metric=None, replicate=REPLICATE,
             trial_steps=STEPS):
    sources = streams.Sources(ids, y, has, streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trained or trial),
                              fp64=streams.InMemory(fp64) if fp64 is not None else None)
    runs = streams.Trajectories(STEPS, trial_steps, 2.0**16, replicate=replicate)
    return streams.compare_streams(kind, rule, sources, runs, metric=metric)


def _classification():
    """Per case, two heads, an FP64 arbiter; one boundary case flips, the trained model is non-finite on an edge case."""
    g = torch.Generator().manual_seed(0)
    ids = [f"ordinary/{i}" for i in range(30)] + ["edge/big", "boundary/a", "boundary/b"]
    ref = {"logits": torch.randn(33, 4, generator=g) * 3, "aux": torch.randn(33, 5, generator=g)}
    ref["logits"][31] = torch.tensor([1.0, 1.001, 0.0, 0.0])
    trial = {k: v.clone() for k, v in ref.items()}
    trial["logits"][31] = torch.tensor([1.001, 1.0, 0.0, 0.0])
    trained = {k: v.clone() for k, v in ref.items()}
    trained["logits"][30] = math.inf
    fp64 = {k: v.double() for k, v in ref.items()}
    has = torch.tensor([True] * 30 + [False] * 3)
    return _compare("classification", ids, ref["logits"].argmax(1), has, ref, trial, trained, fp64)


def _per_token():
    """Per-token scores [N, T, C] with ignored targets: the distribution section and flips at a position."""
    g = torch.Generator().manual_seed(1)
    ids = [f"ordinary/{i}" for i in range(6)]
    ref = {"logits": torch.randn(6, 7, 40, generator=g)}
    trial = {"logits": ref["logits"] + 0.3 * torch.randn(6, 7, 40, generator=g)}
    y = ref["logits"].argmax(-1)
    y[0, :2] = -100
    return _compare("classification", ids, y, torch.ones(6, dtype=torch.bool), ref, trial)


def _regression():
    """Regression with a decision threshold, under a noise rule the trial breaks (the ``over`` list)."""
    g = torch.Generator().manual_seed(2)
    ids = [f"ordinary/{i}" for i in range(20)] + ["edge/zeros"]
    ref = {"output": torch.randn(21, 1, generator=g)}
    trial = {"output": ref["output"] + 0.2}
    rule = AcceptanceConfig(threshold=0.0, outputs={"*": Tolerance(atol=0.01, rtol=0.0)}, loss_noise_multiple=0.5)
    return _compare("regression", ids, ref["output"].clone(), torch.tensor([True] * 20 + [False]), ref, trial, rule=rule,
                    metric=streams.Metric("neg_mae"), replicate=[dataclasses.replace(s, loss=s.loss + 0.001) for s in STEPS],
                    trial_steps=[dataclasses.replace(s, loss=s.loss + 0.01) for s in STEPS])


@pytest.mark.parametrize("made", [_classification, _per_token, _regression])
def test_every_statistic_is_read_and_given_back_key_for_key(made):
    stats = dataclasses.replace(made()[0], env_differs_from_reference=("device",))
    plain = from_jsonable(json.loads(dumps(stats.as_dict())))  # as decide reads it back from stats.json
    typed = Stats.from_dict(plain)
    assert typed.as_dict() == plain and dumps(typed.as_dict()) == dumps(stats.as_dict())
    assert plain["env_differs_from_reference"] == ["device"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.flips = typed.heads


def test_sections_are_typed_where_the_rule_reads_them():
    s, _ = _classification()
    assert set(s.heads) == {"aux"} and s.arbiter["aux"].amp_over_fp32 == 1.0 and s.arbiter["logits"].amp_over_fp32 == math.inf
    assert s.flips.boundary_flips == 1 and s.flips.labels(boundary=True) == ["boundary/a"]
    assert s.flips.labels(boundary=False) == []
    assert s.flips.flip_list[0].reference_scores == pytest.approx((1.0, 1.001, 0.0, 0.0))
    assert s.flips.flip_list[0].position is None
    assert s.nonfinite.trained.ids == ("edge/big",) and s.nonfinite.trial.rows == 0
    assert s.quality.counts["reference"] == (30, 30) and s.quality.paired["trial"].lost == 0 and s.quality.of("trained") == 1.0
    assert s.training.skipped_steps == 1 and s.training.noise is not None and s.training.noise.over == ()
    token = _per_token()[0]
    assert token.flips.unit == "token" and token.distribution.tokens == 40 and token.flips.flip_list[0].position is not None
    assert all("@" in label for label in token.flips.labels(boundary=False))
    reg = _regression()[0]
    assert reg.regression["trial"].mae == pytest.approx(0.2, rel=1e-5)
    assert reg.flips.margin_kind == "logit"  # threshold 0: a sigmoid's boundary, its margins a logit's
    assert reg.training.noise.over == ("mean", "max") and reg.flips.flip_list[0].reference is not None


def test_an_unknown_or_missing_statistic_is_refused_on_read(tmp_path, monkeypatch):
    stats, table = _regression()
    monkeypatch.chdir(tmp_path)
    comparison.write("float16", stats, table)
    assert comparison.read("float16").as_dict() == from_jsonable(json.loads(dumps(stats.as_dict())))
    written = paths.compare("float16") / comparison.STATS
    stale = json.loads(written.read_text())
    del stale["quality"]["paired"]
    written.write_text(json.dumps(stale))
    with pytest.raises(UserError, match=r"not in the form this version reads \(Quality: .*missing key\(s\) \['paired'\]\); "
                                        r"run `dvc repro compare@float16`"):
        comparison.read("float16")
    newer = json.loads(dumps(stats.as_dict()))
    newer["training"]["new_statistic"] = 1
    written.write_text(json.dumps(newer))
    with pytest.raises(UserError, match=r"Training: unknown key\(s\) \['new_statistic'\]"):
        comparison.read("float16")


def test_summary_is_the_flat_numbers_of_the_typed_statistics(tmp_path, monkeypatch):
    stats, table = _classification()
    monkeypatch.chdir(tmp_path)
    comparison.write("bfloat16", stats, table)
    flat = json.loads((paths.compare("bfloat16") / comparison.SUMMARY).read_text())
    assert flat["decisions.boundary_flips"] == 1 and flat["arbiter.aux.amp_over_fp32"] == 1.0
    assert "distribution.kl_mean" not in flat
    assert flat["values.logits.max_abs"] == stats.values["logits"].max_abs and flat["training.real_updates"] == 11
