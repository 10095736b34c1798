"""Users' real models and recipes through a real `dvc repro` to a decision, in both dtypes (issue 10).

Tiny sizes (seconds per stage): a Hugging Face BERT classifier on token ids trained with AdamW, cosine
warmup and gradient accumulation 2 (the model's own loss); a torchvision-style conv net with BatchNorm on
images, trained from a map-style Dataset that is never materialised (one project for both, to keep the lane
short; the tensor path of the same net is what the default digits run exercises). Then kill and resume with
accumulation and a Dataset, byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

import faults
from _project import dvc, env_for, run
from conftest import make_project

pytestmark = pytest.mark.integration

# float16, the dtype with the GradScaler (skips, scale, its state in the checkpoint): the models here are trained and
# judged through it; bfloat16 autocast on a real model runs in tests/test_e2e_lm.py (GPT-2), on the default in `reproduced`.
TO_DECISION = ("repro", "decide@float16")
TRIAL_FILES = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")

BERT = {
    "task": {
        "model": "pipeline.examples.huggingface:build_model",
        "data": "pipeline.examples.huggingface:load_token_data",
        "loss": "model",
        "options": {
            "architecture": "BertForSequenceClassification",
            "n_train": 128,
            "n_eval": 32,
            "classes": 2,
            "config": {
                "model_type": "bert", "vocab_size": 65, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "intermediate_size": 32, "max_position_embeddings": 32, "num_labels": 2,
            },
        },
    },
    "prepare": {"ordinary_cases": 32},
    "reference": {
        "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01, "betas": [0.9, 0.999], "batch_size": 8, "grad_accumulation": 2,
        "train_steps": 8, "checkpoint_every": 4, "boundary_cases": 3, "lr_schedule": {"kind": "cosine", "warmup": 2},
    },
    "acceptance": {"min_quality": None},
}

CONV_DATASET = {
    "task": {
        "model": "pipeline.examples.convnet:build_model", "data": "pipeline.examples.convnet:load_dataset",
        "options": {"width": 4},
    },
    "prepare": {"ordinary_cases": 32, "edge_samples": 1},
    "reference": {
        "batch_size": 16, "grad_accumulation": 2, "optimizer": "adam", "lr": 0.003, "train_steps": 8, "checkpoint_every": 4,
        "boundary_cases": 2,
    },
    "acceptance": {"min_quality": None},
}


def decisions(repo: Path) -> dict[str, str]:
    folders = [d for d in (repo / "data/decision").iterdir() if d.is_dir()]
    return {d.name: json.loads((d / "decision.json").read_text())["decision"] for d in folders}


@pytest.fixture(scope="module")
def dataset_project(tmp_path_factory) -> Path:
    repo = make_project(tmp_path_factory.mktemp("dataset") / "repo", CONV_DATASET)
    dvc(repo, *TO_DECISION)
    return repo


def test_hugging_face_bert_on_token_ids_with_adamw_cosine_warmup_and_accumulation(tmp_path):
    repo = make_project(tmp_path / "repo", BERT)
    dvc(repo, *TO_DECISION)
    assert decisions(repo).keys() == {"float16"} and set(decisions(repo).values()) <= {"accept", "rollback"}
    cases = run([sys.executable, "-c", "from pipeline import cases; c = cases.load('data/reference/cases.safetensors'); "
                 "print(sorted(c.x), c.x['input_ids'].dtype, sorted(set(c.kinds)))"], repo).stdout
    # token ids: boundary cases are selected real samples
    assert "['attention_mask', 'input_ids'] torch.int64 ['edge', 'ordinary', 'selected']" in cases
    steps = json.loads((repo / "data/reference/trajectory.json").read_text())["steps"]
    assert len(steps) == 8 and steps[0]["lr"] == pytest.approx(0.005)  # warmup: 1 of 2 real updates done
    assert steps[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine ends at 0
    replicate = json.loads((repo / "data/reference/replicate_trajectory.json").read_text())["steps"]
    assert len(replicate) == 8 and replicate != steps


def test_conv_net_with_batchnorm_on_images_trained_from_a_dataset_that_is_not_a_tensor(dataset_project):
    assert decisions(dataset_project).keys() == {"float16"}
    assert set(decisions(dataset_project).values()) <= {"accept", "rollback"}
    prepared = run([sys.executable, "-c", "from pipeline.files import read_tensors; "
                    "t, m = read_tensors('data/prepared/train.safetensors'); print(sorted(t), m['dataset']['length'])"],
                   dataset_project).stdout
    assert prepared.split() == ["['length']", str(5 * 1348)]  # 5 shifted views of 1348 digits, never materialised
    manifest = json.loads((dataset_project / "data/reference/manifest.json").read_text())
    assert manifest["cases"]["edge"] == 5  # zeros, min, max, 2 scaled images
    assert manifest["cases"].get("boundary", 0) + manifest["cases"].get("selected", 0) == 2
    steps = json.loads((dataset_project / "data/trial/float16/trajectory.json").read_text())["steps"]
    assert len(steps) == 8 and steps[-1]["real_updates"] == 8 - sum(s["skipped"] for s in steps)


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in TRIAL_FILES}


@pytest.mark.parametrize("kill_after", [3, 6])
def test_kill_and_resume_with_accumulation_and_a_dataset_is_byte_identical(dataset_project, tmp_path, kill_after):
    repo = tmp_path / "repo"
    shutil.copytree(dataset_project, repo, symlinks=True)
    trial = repo / "data/trial/float16"
    expected = digests(trial)
    shutil.rmtree(trial)
    env = faults.after_step(env_for(repo), kill_after)
    killed = run([sys.executable, "-m", "pipeline", "trial", "--variant", "float16"], repo, check=False, env=env)
    assert killed.returncode == -signal.SIGKILL
    assert (repo / "data/resume/trial-float16.safetensors").exists() == (kill_after >= 4)
    run([sys.executable, "-m", "pipeline", "trial", "--variant", "float16"], repo)
    assert digests(trial) == expected


# 8 updates, a resumable state every 4: kill in the reference's training (5), or in the FP32 replicate's (8 + 6).
@pytest.mark.parametrize("kill_after", [5, 14])
def test_killed_freeze_resumes_to_an_identical_reference_with_a_dataset(dataset_project, tmp_path, kill_after):
    repo = tmp_path / "repo"
    shutil.copytree(dataset_project, repo, symlinks=True)
    reference = repo / "data/reference"
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(reference.iterdir()) if p.is_file()}
    assert "replicate_trajectory.json" in expected
    shutil.rmtree(reference)
    env = faults.after_step(env_for(repo), kill_after)
    assert run([sys.executable, "-m", "pipeline", "freeze"], repo, check=False, env=env).returncode == -signal.SIGKILL
    assert not reference.exists() or not any(reference.iterdir())
    states = sorted(p.name for p in (repo / "data/resume").glob("*.safetensors"))
    assert states == (["reference.safetensors", "replicate.safetensors"] if kill_after > 8 else ["reference.safetensors"])
    run([sys.executable, "-m", "pipeline", "freeze"], repo)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(reference.iterdir()) if p.is_file()} == expected
    assert not any((repo / "data/resume").glob("*.safetensors"))
