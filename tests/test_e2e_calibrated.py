"""Calibrated training verdicts through a real `dvc repro` (issue 48): a user's own classifier, a tiny DistilBERT on
token ids trained with AdamW for 150 steps, long enough that two FP32 runs on other data orders decorrelate (their
accuracy after training differs by several points). Healthy float16 AMP and FP32 again on another data order are
accepted; bfloat16, whose training this model breaks on purpose (no gradient reaches the encoder under bfloat16
autocast: training stalls at chance), is rolled back on training alone, naming where it ended and its quality. And the
fixed per-step band the last round shipped (0.05 nats + 10 %) is one FP32 itself fails on this reference: freeze's A/A
refuses it.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from _project import dvc
from conftest import make_project
from pipeline import refusals
from pipeline.artifacts.steps import StepRecord
from pipeline.config import AcceptanceConfig

pytestmark = pytest.mark.integration

MODEL = """
import torch
from pipeline.examples import huggingface


def _autocast_dtype():
    try:
        on = torch.is_autocast_enabled("cpu")
    except TypeError:  # torch before 2.4's device argument
        on = torch.is_autocast_cpu_enabled()
    return torch.get_autocast_dtype("cpu") if on else None


class Classifier(torch.nn.Module):
    def __init__(self, broken_under=None, **options):
        super().__init__()
        self.inner = huggingface.build_model(**options)
        self.broken_under = broken_under

    def forward(self, input_ids, attention_mask):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        if self.training and self.broken_under and str(_autocast_dtype()) == f"torch.{self.broken_under}":
            logits = logits.detach() + 0.0 * logits  # the encoder gets no gradient: training stalls under this dtype
        return logits


def build_model(broken_under=None, **options):
    return Classifier(broken_under, **options)


def load_data(broken_under=None, **options):
    return huggingface.load_token_data(**options)
"""

DISTILBERT = {"model_type": "distilbert", "vocab_size": 65, "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64,
              "max_position_embeddings": 32, "num_labels": 4}


def test_a_decorrelated_classifier_is_accepted_within_fp32s_spread_and_a_stalled_training_is_not(tmp_path):
    repo = make_project(tmp_path / "repo", {
        "task": {"model": "usermod:build_model", "data": "usermod:load_data", "loss": "cross_entropy",
                 "options": {"architecture": "DistilBertForSequenceClassification", "config": DISTILBERT, "n_train": 512,
                             "n_eval": 128, "classes": 4, "broken_under": "bfloat16"}},
        "prepare": {"ordinary_cases": 128},
        "reference": {"optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01, "batch_size": 16, "train_steps": 150,
                      "checkpoint_every": 0, "boundary_cases": 4},
        "acceptance": {"min_quality": None, "outputs": {"*": {"atol": 0.05, "rtol": 0.02}}},
        "trial": {"variants": ["float16", "bfloat16", "float32_swapped"]},
        "diagnose": {"search_budget": 0},
    })
    (repo / "usermod.py").write_text(textwrap.dedent(MODEL))
    dvc(repo, "repro", "--glob", "decide@*")

    def decision(variant: str) -> dict:
        return json.loads((repo / f"data/decision/{variant}/decision.json").read_text())

    # FP32 itself moved: the replicates' accuracy after training differs from the reference's
    spread = json.loads((repo / "data/reference/replicate_trajectory.json").read_text())["quality"]
    assert len(spread["replicates"]) == 2 and max(abs(q - spread["reference"]) for q in spread["replicates"]) >= 0.03, spread
    for healthy in ("float16", "float32_swapped"):
        d = decision(healthy)
        assert d["decision"] == "accept", (healthy, d["reasons"])
        assert any(c.startswith("training: final loss") and "within it" in c for c in d["checks"]), d["checks"]
    broken = decision("bfloat16")
    assert broken["decision"] == "rollback" and broken["training"] == "rollback" and broken["inference"] == "accept"
    reasons = " | ".join(broken["reasons"])
    assert "training did not reach where FP32 does" in reasons and "quality after training" in reasons, reasons

    # The fixed band the last round shipped: FP32's own replicates leave it, so freeze would refuse it (its A/A).
    def steps(path: str, key: str = "steps") -> list[StepRecord]:
        return [StepRecord.from_dict(s) for s in json.loads((repo / path).read_text())[key]]

    ref = steps("data/reference/trajectory.json")
    replicates = json.loads((repo / "data/reference/replicate_trajectory.json").read_text())
    first = [StepRecord.from_dict(s) for s in replicates["steps"]]
    more = [[StepRecord.from_dict(s) for s in run] for run in replicates.get("more", [])]
    line = refusals.problem(AcceptanceConfig(loss_atol=0.05, loss_rtol=0.1), refusals.Facts("classification", {"logits": (4,)},
                         {"logits": 1.0}, 0.5, "accuracy", True, ref, replicate=first, more_replicates=more))
    assert line is not None and "FP32's own replicate (another data order) leaves this per-step band" in line, line
