"""FP32's A/A through a real `dvc repro` (issue 48, item 2): the variant float32_swapped trains FP32 again on another
data order than the reference's and its replicate's, nothing else changed. The rule should accept it, its checks
naming the noise floor it was judged by: the loss curve against FP32's own gap, quality against FP32's own spread.
bfloat16 runs beside it on the tiny default example (its verdict is the tiny rule's, not asserted here).
"""

from __future__ import annotations

import json

import pytest

from _project import dvc
from conftest import make_project

pytestmark = pytest.mark.integration


def test_fp32_on_another_data_order_is_accepted_by_the_noise_floor(tmp_path):
    repo = make_project(tmp_path / "repo", {"trial": {"variants": ["bfloat16", "float32_swapped"]}})
    dvc(repo, "repro", "--glob", "decide@*")
    decision = json.loads((repo / "data/decision/float32_swapped/decision.json").read_text())
    assert decision["decision"] == "accept", decision["reasons"]
    assert decision["policy"] == {"dtype": "float32", "fp32_modules": [], "data_order": "swapped"}
    checks = " | ".join(decision["checks"])
    assert "training: loss curve within the noise floor (3 x FP32's own run-to-run gap" in checks, checks
    assert "FP32's own spread: its replicate" in checks, checks
    trajectory = json.loads((repo / "data/trial/float32_swapped/trajectory.json").read_text())
    reference = json.loads((repo / "data/reference/trajectory.json").read_text())
    losses = [[s["loss"] for s in t["steps"]] for t in (trajectory, reference)]
    assert losses[0] != losses[1]  # trained on another order: a real second FP32 run, not the reference's bytes
    assert (repo / "data/decision/bfloat16/decision.json").is_file()
