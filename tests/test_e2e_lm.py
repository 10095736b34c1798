"""Language models end to end with real `dvc repro`: the built-in causal LM and a tiny Hugging Face GPT-2
(random init from a config, nothing downloaded). Per-token outputs give KL and top-1 agreement in stats.json."""

import json

import pytest

from _project import dvc
from conftest import make_project

pytestmark = pytest.mark.integration

LM = {
    "task": {
        "model": "pipeline.examples.lm:build_model",
        "data": "pipeline.examples.lm:load_data",
        "options": {"n_train": 256, "n_eval": 16, "seq_len": 16, "vocab": 32, "d_model": 32, "layers": 1, "heads": 2},
    },
    "prepare": {"ordinary_cases": 16, "edge_samples": 1},
    "reference": {"train_steps": 8, "batch_size": 32, "optimizer": "adam", "lr": 0.003, "boundary_cases": 2},
    "trial": {"variants": ["bfloat16"]},
    # The rule names distribution criteria before the trial, like every other criterion.
    "acceptance": {"outputs": {"*": {"atol": 0.05, "rtol": 0.02}}, "min_quality": None, "max_kl_mean": 0.01, "max_kl_p99": 0.05,
                   "min_top1_agreement": 0.9, "boundary_margin_kind": "probability", "boundary_margin": 0.02},
}

GPT2 = {
    "task": {
        "model": "pipeline.examples.huggingface:build_model",
        "data": "pipeline.examples.lm:load_data",
        "options": {"architecture": "GPT2LMHeadModel", "n_train": 128, "n_eval": 8, "seq_len": 16, "vocab": 32,
                    "config": {"model_type": "gpt2", "vocab_size": 32, "n_positions": 16, "n_embd": 32, "n_layer": 1,
                               "n_head": 2}},
    },
    "prepare": {"ordinary_cases": 8, "edge_samples": 1},
    "reference": {"train_steps": 4, "batch_size": 32, "optimizer": "adam", "lr": 0.003, "boundary_cases": 2},
    "trial": {"variants": ["bfloat16"]},
    "acceptance": {
        "outputs": {"*": {"atol": 0.1, "rtol": 0.05}}, "min_quality": None, "max_kl_mean": 0.05, "min_top1_agreement": 0.8,
    },
}


def _check_per_token(repo, tokens_per_case):
    stats = json.loads((repo / "data/compare/bfloat16/stats.json").read_text())
    dist = stats["distribution"]
    assert stats["flips"]["unit"] == "token"
    assert dist["tokens"] > 0 and 0.0 <= dist["kl_mean"] <= dist["kl_p99"] <= dist["kl_max"]
    assert 0.0 <= dist["top1_agreement"] <= 1.0 and 0.0 <= dist["top_k_overlap"] <= 1.0
    assert stats["quality"]["metric"] == "token_accuracy" and stats["quality"]["perplexity"]["reference"] > 1.0
    table = json.loads((repo / "data/compare/bfloat16/cases.json").read_text())
    assert table and all({"worst_token", "kl_mean", "kl_max", "flipped_tokens"} <= set(r) for r in table)
    assert all(0 <= r["worst_token"] < tokens_per_case for r in table)
    decision = json.loads((repo / "data/decision/bfloat16/decision.json").read_text())
    text = " ".join(decision["reasons"] + decision["checks"])
    assert "KL(reference || trial) mean" in text and "top-1 agreement" in text
    return stats


def test_builtin_causal_lm_end_to_end(tmp_path):
    repo = make_project(tmp_path / "repo", LM)
    dvc(repo, "repro")
    stats = _check_per_token(repo, 16)
    assert stats["flips"]["margin_kind"] == "probability"
    # MLflow mirrors them: the variant's run carries KL and top-1 agreement as metrics.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("amp-validation")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.dtype = 'bfloat16'")
    metrics = [r.data.metrics for r in runs if "kl_mean" in r.data.metrics]
    assert metrics and metrics[0]["kl_mean"] == pytest.approx(stats["distribution"]["kl_mean"])
    assert metrics[0]["top1_agreement"] == pytest.approx(stats["distribution"]["top1_agreement"])


def test_tiny_gpt2_from_a_config_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    repo = make_project(tmp_path / "repo", GPT2)
    dvc(repo, "repro", "decide@bfloat16")  # the stages that read per-token outputs; the LM test runs the whole pipeline
    _check_per_token(repo, 16)
