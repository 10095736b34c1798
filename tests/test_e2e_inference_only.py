"""Inference-only verdicts through a real `dvc repro` (issue 52 item 1): ``reference.train_steps: 0`` asks "can this
model, as built, run in reduced precision?". freeze trains no reference and no replicate, the trials train nothing,
and decide applies the inference criteria alone; the training part says "not judged", never "accept".

The FP16 overflow example (pipeline/examples/stress.py): its ``amplify`` layer's outputs reach ~1e5, beyond FP16's
65504, from its very first forward pass, so float16 rolls back on inference while bfloat16 (FP32's exponent range) is
accepted. Untrained, the model classifies at chance: the rule sets no minimum quality (max_quality_drop still holds).
"""

from __future__ import annotations

import json

import pytest

from _project import dvc, example
from conftest import make_project

pytestmark = pytest.mark.integration

INFERENCE_ONLY = {
    "reference": {"train_steps": 0},
    "acceptance": {"min_quality": None, "outputs": {"*": {"atol": 0.05, "rtol": 0.02}}},
    "trial": {"variants": ["float16", "bfloat16"]},
    "diagnose": {"probe": "on_failure", "search_budget": 0},
}


def read(repo, path):
    return json.loads((repo / path).read_text())


def test_inference_only_accepts_bfloat16_and_rolls_back_float16s_overflow(tmp_path):
    base = {k: v for k, v in example("stress_overflow").items() if k in ("task",)}
    repo = make_project(tmp_path / "repo", {**base, **INFERENCE_ONLY})
    out = dvc(repo, "repro", "--glob", "decide@*").stdout

    assert "freeze: reference not trained (reference.train_steps 0: inference only)" in out, out
    assert not (repo / "data/reference/replicate_trajectory.json").exists()  # no replicate trained
    assert read(repo, "data/reference/trajectory.json")["steps"] == []
    for variant in ("float16", "bfloat16"):
        assert read(repo, f"data/trial/{variant}/trajectory.json")["steps"] == [], variant
        assert f"trial {variant}: inference only" in out, out

    healthy = read(repo, "data/decision/bfloat16/decision.json")
    assert (healthy["decision"], healthy["inference"], healthy["training"]) == ("accept", "accept", "not judged"), healthy
    assert any(c.startswith("training: not judged") for c in healthy["checks"]), healthy["checks"]
    assert not any(c.startswith("training:") and "not judged" not in c for c in healthy["checks"]), healthy["checks"]
    assert "bfloat16: ACCEPT" in out and "(inference only: training not judged)" in out, out

    broken = read(repo, "data/decision/float16/decision.json")
    assert (broken["decision"], broken["inference"], broken["training"]) == ("rollback", "rollback", "not judged")
    assert not any(r.startswith("training") for r in broken["reasons"]), broken["reasons"]
    assert "non-finite" in " ".join(broken["reasons"]), broken["reasons"]
    assert "float16: ROLLBACK" in out and "training NOT JUDGED" in out, out

    # The accepted variant's benchmark times what was judged: a forward pass, said in its method.
    dvc(repo, "repro", "benchmark@bfloat16")
    method = read(repo, "data/benchmark/bfloat16/benchmark.json")["method"]
    assert method["timed"].startswith("inference: one forward pass"), method
