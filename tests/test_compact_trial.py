"""The real stages under ``compare.store: compact``: trial@NAME keeps each token's KL against the reference's full
scores, and compare reads the very numbers it computes under ``full`` (the built-in causal LM; stages run directly,
as ``dvc repro`` runs them, with the reference frozen full, as the KL needs it)."""

import json

import pytest

from _project import stage, write_params
from conftest import make_project
from test_e2e_lm import LM

pytestmark = pytest.mark.integration


def _stats(repo):
    return json.loads((repo / "data/compare/bfloat16/stats.json").read_text())


def test_the_trial_stage_keeps_compare_s_kl_and_compare_reads_it(tmp_path):
    from pipeline.artifacts import outputs

    repo = make_project(tmp_path / "repo", {**LM, "compare": {"store": "full"}})
    for args in (["prepare"], ["freeze"], ["trial", "--variant", "bfloat16"], ["compare", "--variant", "bfloat16"]):
        stage(repo, *args, check=True)
    full = _stats(repo)
    write_params(repo, {"compare": {"store": "compact"}})  # the trial and compare only: the reference stays full
    for args in (["trial", "--variant", "bfloat16"], ["compare", "--variant", "bfloat16"]):
        stage(repo, *args, check=True)
    small = _stats(repo)
    reader = outputs.OutputsReader(repo / "data/trial/bfloat16/outputs.safetensors")
    assert reader.store == "compact" and reader.kl("output") is not None
    f, s = full["distribution"], small["distribution"]
    assert s["store"] == {"reference": "full", "trial": "compact"} and s["kl_mean_bound"] == s["kl_p99_bound"] == 0.0
    for key in ("tokens", "kl_mean", "kl_mean_se", "kl_p99", "kl_p99_upper", "kl_max", "kl_quantiles", "top1_agreement"):
        assert s[key] == f[key], key
    assert f["kl_mean"] > 0.0


def test_an_inference_only_compact_trial_writes_its_outputs_once_and_compare_reads_both_files(tmp_path):
    """``reference.train_steps: 0``: the trial's trained outputs are its outputs, copied byte for byte, compact KL and
    all (``trial_tensors.Writer.sink``); compare reads both as it reads a trained trial's."""
    from pipeline.artifacts import outputs

    repo = make_project(tmp_path / "repo", {**LM, "reference": {**LM.get("reference", {}), "train_steps": 0},
                                            "compare": {"store": "compact"}})
    for args in (["prepare"], ["freeze"], ["trial", "--variant", "bfloat16"], ["compare", "--variant", "bfloat16"]):
        stage(repo, *args, check=True)
    trial = repo / "data/trial/bfloat16"
    assert (trial / "outputs.safetensors").read_bytes() == (trial / "trained_outputs.safetensors").read_bytes()
    files = json.loads((trial / "manifest.json").read_text())["files"]
    assert files["outputs.safetensors"] == files["trained_outputs.safetensors"]
    assert outputs.OutputsReader(trial / "trained_outputs.safetensors").kl("output") is not None
    assert _stats(repo)["distribution"]["store"] == {"reference": "full", "trial": "compact"}
