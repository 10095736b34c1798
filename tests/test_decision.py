"""The decision artifact (pipeline/artifacts/decision.py): typed, written and read by one module, short metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pipeline import paths

from pipeline.artifacts import decision
from pipeline.artifacts.comparison import Stats
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig
from pipeline.errors import UserError
from _steps import step

def compared() -> Stats:
    """Real statistics (compare_streams) of a 10-case classifier whose trial flips ordinary/0 with a clear margin."""
    g = torch.Generator().manual_seed(0)
    ids = [f"ordinary/{i}" for i in range(10)]
    ref = torch.randn(10, 3, generator=g) * 3
    trial = ref.clone()
    trial[0] = -ref[0]
    steps = [step(i, 1.0 / (i + 1), scale=32768.0) for i in range(20)]
    sources = streams.Sources(ids, ref.argmax(1), torch.ones(10, dtype=torch.bool), streams.InMemory({"logits": ref}),
                              streams.InMemory({"logits": trial}), streams.InMemory({"logits": ref}))
    return streams.compare_streams("classification", AcceptanceConfig(), sources, streams.Trajectories(steps, steps, 32768.0))[0]


def made(result: str = "accept", **extra) -> decision.Decision:
    return decision.Decision(
        variant="bfloat16", decision=result, reasons=[] if result == "accept" else ["values 'logits': too far"], checks=["ok"],
        rule={"max_flips": 0}, rule_sha256="a" * 64, policy={"dtype": "bfloat16", "fp32_modules": []}, env={"backend": "cpu"},
        **extra,
    )


def test_written_and_read_back_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = made("rollback", findings=["module '5' in FP32 gives the class back"], notes=["the trial ran elsewhere"],
             rollback_package="data/decision/bfloat16/rollback")
    decision.write(d)
    assert decision.read("bfloat16") == d and not decision.read("bfloat16").accepted
    raw = json.loads((tmp_path / paths.decision("bfloat16") / "decision.json").read_text())
    # reasons and findings are kept apart
    assert raw["reasons"] == ["values 'logits': too far"] and raw["findings"] == ["module '5' in FP32 gives the class back"]
    accepted = made()
    decision.write(accepted)
    raw = json.loads((tmp_path / paths.decision("bfloat16") / "decision.json").read_text())
    assert not {"findings", "notes", "rollback_package", "cases"} & set(raw)  # only what happened
    assert decision.read("bfloat16") == accepted
    with pytest.raises(dataclasses.FrozenInstanceError):
        accepted.reasons = ["edited"]


def test_a_decision_of_another_format_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    decision.write(made())
    path = tmp_path / paths.decision("bfloat16") / "decision.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "verdict": "accept"}))
    with pytest.raises(UserError, match=r"not a decision of this version; rebuild it with `dvc repro --force decide@bfloat16`"):
        decision.read("bfloat16")


def test_short_metrics_say_the_verdicts_in_words_then_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = made("rollback", inference="rollback", findings=["first non-finite loss at training step 3"])
    stats = compared()
    decision.write_metrics(d, stats)
    written = json.loads((tmp_path / "data/metrics/bfloat16.json").read_text())
    assert written == {
        "decision": "rollback",
        "reasons": 1,  # the failed criteria, as the report counts them: the diagnosis' finding is not one
        "flips": 1,  # every real flip, near the boundary or not
        "near_flips": 0,
        "max_gap": stats.max_abs_gap,
        "quality_trial": 0.9,
        "quality_trained": 1.0,
        "loss_gap": 0.0,
    }
    assert stats.max_abs_gap > 0
    assert paths.decision_metrics("bfloat16") == Path("data/metrics/bfloat16.json")
