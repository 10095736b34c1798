"""Resume states and checkpoints (pipeline/checkpoint.py): a damaged resume state is refused in one line.

Real resume files: real safetensors written by ``ResumeFile.save`` from a real model's state, trained a few steps under
a GradScaler; ``ResumeFile.load`` must refuse each damage in one line (training then restarts from step 0).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import faults
import pytest
import torch

from pipeline import checkpoint, training
from pipeline.config import Policy, ReferenceConfig, TaskConfig
from pipeline.files import write_tensors
from pipeline.task import TensorSource


def _state(tmp_path: Path, dtype: str = "float16") -> tuple[checkpoint.ResumeFile, checkpoint.Checkpoint]:
    """A real resume state: a tiny MLP trained 3 steps under a GradScaler, saved at step 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    cfg = ReferenceConfig(train_steps=3, batch_size=8, checkpoint_every=2)
    saved: list[checkpoint.Checkpoint] = []
    training.train(
        model, TensorSource(x, y), cfg, TaskConfig(), Policy(dtype=dtype), torch.device("cpu"), 0, save_resume=saved.append
    )
    resume = checkpoint.ResumeFile(tmp_path / "trial.safetensors", "run-key", "cpu")
    resume.save(saved[0])
    return resume, saved[0]


def _rewrite(resume: checkpoint.ResumeFile, change, rehash: bool) -> None:
    """Edit the saved metadata. ``rehash``: the sidecar follows (a writer bug, not damage on disk)."""
    tensors, meta = checkpoint.read_tensors(resume.path)
    change(meta)
    digest = write_tensors(resume.path, tensors, meta)
    if rehash:
        resume.sidecar.write_text(f"{digest}  {resume.path.name}\n")


def test_an_intact_state_is_resumed(tmp_path, capsys):
    resume, saved = _state(tmp_path)
    loaded = resume.load(scaler=True)  # a float16 run's: its GradScaler is enabled
    assert loaded is not None and loaded.meta["step"] == 2
    assert torch.equal(loaded.tensors["model/0.weight"], saved.tensors["model/0.weight"])
    assert capsys.readouterr().err == ""


def _scale(value):
    def change(meta):
        meta["grad_scaler"]["scale"] = value

    return change


def _drop(key):
    def change(meta):
        del meta["grad_scaler"][key]

    return change


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("flip", "sha256"),
        ("scale 65536 -> 75536", "sha256"),
        ("no sidecar", "sha256 record"),
        ("truncated", "not a readable safetensors file"),
        ("NaN scale, rehashed", "scale is nan"),
        ("negative scale, rehashed", "scale is -1.0"),
        ("no growth_factor, rehashed", "lacks growth_factor"),
        ("records cut, rehashed", "records do not match step 2"),
        ("empty scaler, rehashed", "grad_scaler is empty (a disabled scaler's), but this run's GradScaler is enabled"),
    ],
)
def test_a_damaged_resume_state_is_refused_in_one_line(tmp_path, capsys, damage, why):
    resume, _ = _state(tmp_path)
    if damage == "flip":
        faults.flip_exponent_bit(resume.path)
    elif damage.startswith("scale"):
        _rewrite(resume, _scale(75536.0), rehash=False)
    elif damage == "no sidecar":
        resume.sidecar.unlink()
    elif damage == "truncated":
        resume.path.write_bytes(resume.path.read_bytes()[:-7])
    elif damage.startswith("NaN"):
        _rewrite(resume, _scale(math.nan), rehash=True)
    elif damage.startswith("negative"):
        _rewrite(resume, _scale(-1.0), rehash=True)
    elif damage.startswith("no growth_factor"):
        _rewrite(resume, _drop("growth_factor"), rehash=True)
    elif damage.startswith("empty scaler"):  # resumed, the scale would restart at 65536 mid-run: no uninterrupted run's result
        _rewrite(resume, lambda meta: meta.update(grad_scaler={}), rehash=True)
    else:
        _rewrite(resume, lambda meta: meta.update(records=meta["records"][:1]), rehash=True)
    assert resume.load(scaler=True) is None  # training restarts from step 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: {resume.path}: resume state ") and why in err[0] and "restarts from step 0" in err[0]


def test_a_scaler_state_is_checked_key_by_key():
    good = torch.amp.GradScaler("cpu").state_dict()
    assert checkpoint.scaler_problem(good, enabled=True) is None
    assert checkpoint.scaler_problem({}) is None  # a disabled scaler (bfloat16, FP32)
    assert "not > 0" in checkpoint.scaler_problem({**good, "scale": 0.0})
    assert "finite" in checkpoint.scaler_problem({**good, "scale": math.inf})
    assert "finite" in checkpoint.scaler_problem({**good, "growth_interval": "2000"})
    assert "out of range" in checkpoint.scaler_problem({**good, "backoff_factor": 1.5})
    assert "lacks _growth_tracker" in checkpoint.scaler_problem({k: v for k, v in good.items() if k != "_growth_tracker"})
    # Which scaler this run has: an enabled one's state is no disabled scaler's, nor {} an enabled one's.
    assert checkpoint.scaler_problem(good, enabled=True) is None
    assert "this run's GradScaler is disabled" in checkpoint.scaler_problem(good, enabled=False)
    assert "this run's GradScaler is enabled" in checkpoint.scaler_problem({}, enabled=True)


def test_the_resume_key_covers_threads_and_code(tmp_path, monkeypatch, capsys):
    resume, _ = _state(tmp_path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    other = checkpoint.ResumeFile(resume.path, "run-key", "cpu")
    assert other.load() is None
    err = capsys.readouterr().err
    assert err == (f"warning: {resume.path} was saved by another run (threads 1 -> 7 differ); "
                   "ignored, training restarts from step 0\n")


def test_the_code_digest_covers_a_task_module_outside_the_package(tmp_path, monkeypatch):
    (tmp_path / "mymodel_r24.py").write_text("ACT = 'relu'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mymodel_r24  # noqa: F401  (imported as a task's model module would be)

    before = checkpoint.code_digest()
    assert "mymodel_r24" in before and any(k.startswith("pipeline/") for k in before)
    (tmp_path / "mymodel_r24.py").write_text("ACT = 'tanh'\n")
    assert checkpoint.code_digest()["mymodel_r24"] != before["mymodel_r24"]
    sys.modules.pop("mymodel_r24")


def test_the_initial_weights_hash_sees_one_bit():
    a = {"w": torch.ones(3)}
    b = {"w": torch.ones(3)}
    b["w"][1] = torch.nextafter(b["w"][1], torch.tensor(2.0))
    assert checkpoint.tensors_digest(a) != checkpoint.tensors_digest(b)


def test_a_trials_resume_key_follows_the_recipe_and_the_task_modules_params_name_now(tmp_path, monkeypatch):
    """The trial's resume key holds ``reference_tensors.recipe_key``: an lr edited after freeze, or the source of a
    custom loss module (imported only once training starts, after the resume state was opened), changes it; a change
    of the FP64 arbiter's size, which trains nothing, does not."""
    import dataclasses

    from pipeline.artifacts import reference_tensors
    from pipeline.config import Params, ReferenceConfig, TaskConfig

    module = tmp_path / "mylosses.py"
    module.write_text("import torch\n\ndef loss(out, y):\n    return torch.nn.functional.cross_entropy(out, y)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    params = dataclasses.replace(Params(), task=dataclasses.replace(TaskConfig(), loss="mylosses:loss"))
    key = reference_tensors.recipe_key(params)
    assert reference_tensors.recipe_key(dataclasses.replace(params, reference=ReferenceConfig(lr=0.2))) != key
    arbiter = dataclasses.replace(params, reference=dataclasses.replace(params.reference, fp64_arbiter=7))
    assert reference_tensors.recipe_key(arbiter) == key
    module.write_text(module.read_text().replace("(out, y)", "(out, y, label_smoothing=0.2)"))
    assert reference_tensors.recipe_key(params) != key


def test_the_noise_replicates_state_is_never_taken_for_the_references(tmp_path, capsys):
    """freeze's replicate repeats the reference on another data order: its resume state, copied over the reference's
    (sidecar and all), is another run's, ignored with one line, never resumed as the reference."""
    from pipeline import distributed

    world = distributed.current()
    reference = checkpoint.ResumeFile(tmp_path / "reference.safetensors", world.key("run-key"), "cpu")
    replicate = checkpoint.ResumeFile(tmp_path / "replicate.safetensors", world.key(training.replicate_key("run-key")), "cpu")
    replicate.save(checkpoint.capture(torch.nn.Linear(2, 2), step=4))
    reference.path.write_bytes(replicate.path.read_bytes())
    reference.sidecar.write_bytes(replicate.sidecar.read_bytes())
    assert reference.load() is None
    assert "was saved by another run" in capsys.readouterr().err
    assert replicate.load().meta["step"] == 4
