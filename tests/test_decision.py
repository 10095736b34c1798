"""The decision artifact (pipeline/artifacts/decision.py): typed, written and read by one module, short metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import paths

from pipeline.artifacts import decision
from pipeline.artifacts.comparison import Stats

STATS = {
    "values": {"logits": {"max_abs": 0.004}, "aux": {"max_abs": 0.25}},
    "flips": {"flips": 1, "near_boundary_flips": 2, "boundary_flips": 3, "boundary_cases": 9, "flip_list": []},
    "quality": {"reference": 0.95, "trial": 0.94, "trained": 0.93},
    "training": {"max_loss_gap": 0.0125},
}


def made(result: str = "accept", **extra) -> decision.Decision:
    return decision.Decision(
        dtype="bfloat16", decision=result, reasons=[] if result == "accept" else ["values 'logits': too far"], checks=["ok"],
        rule={"max_flips": 0}, rule_sha256="a" * 64, policy={"dtype": "bfloat16", "fp32_modules": []}, env={"backend": "cpu"}, **extra,
    )


def test_written_and_read_back_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = made("rollback", notes=["the trial ran elsewhere"], rollback_package="data/decision/bfloat16/rollback")
    decision.write(d)
    assert decision.read("bfloat16") == d and not decision.read("bfloat16").accepted
    accepted = made()
    decision.write(accepted)
    raw = json.loads((tmp_path / paths.decision("bfloat16") / "decision.json").read_text())
    assert "notes" not in raw and "rollback_package" not in raw  # only what happened
    assert decision.read("bfloat16") == accepted


def test_short_metrics_say_the_verdicts_in_words_then_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = made("rollback", inference="rollback")
    decision.write_metrics(d, Stats(STATS))
    written = json.loads((tmp_path / "data/metrics/bfloat16.json").read_text())
    assert written == {
        "decision": "rollback",
        "inference": "rollback",
        "training": "accept",
        "reasons": 1,
        "flips": 3,  # every real flip, near the boundary or not
        "near_flips": 2,
        "max_gap": 0.25,
        "quality_trial": 0.94,
        "quality_trained": 0.93,
        "loss_gap": 0.0125,
    }
    assert paths.decision_metrics("bfloat16") == Path("data/metrics/bfloat16.json")
