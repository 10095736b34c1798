"""Bad input from real models and recipes (issue 10): one line naming the problem and the fix, exit 2, nothing written."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from _project import ROOT, env_for, merge, run
from _project import params as read_params

pytestmark = pytest.mark.integration

DATA = """
import torch
def load_data(**_):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g); y = torch.randint(0, 3, (40,), generator=g)
    return {"train_x": x, "train_y": y, "eval_x": x[:8], "eval_y": y[:8]}
def build_model(**_):
    return torch.nn.Linear(4, 3)
"""

CASES = {
    "dict batch disagreeing on dim 0": (
        DATA + """
def bad_data(**_):
    ids = torch.zeros(40, 5, dtype=torch.long)
    return {"train_x": {"input_ids": ids, "attention_mask": ids[:39]}, "train_y": torch.zeros(40, dtype=torch.long),
            "eval_x": {"input_ids": ids[:8], "attention_mask": ids[:8]}, "eval_y": torch.zeros(8, dtype=torch.long)}
""",
        {"task": {"data": "usermod:bad_data"}},
        "prepare",
        ["tensors of train_x disagree on their first dimension", "attention_mask: 39", "input_ids: 40"],
    ),
    "model output with no logits and no tensor": (
        DATA + """
class Opaque(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return {self.fc(x).sum().item()}  # a set: neither a tensor, a tuple, a dict nor an object with .logits
def bad_model(**_):
    return Opaque()
""",
        {"task": {"model": "usermod:bad_model"}},
        "freeze",
        ["returned set with no tensor and no .logits", "return a tensor, a tuple, a dict of named tensors, or an object"],
    ),
    "optimizer factory returning no optimizer": (
        DATA + """
def bad_optimizer(params):
    return {"lr": 0.1}
""",
        {"reference": {"optimizer": "usermod:bad_optimizer"}},
        "freeze",
        ["reference.optimizer usermod:bad_optimizer returned dict", "return a torch.optim.Optimizer"],
    ),
    "label_key missing from the batch": (
        DATA + """
def bad_data(**_):
    ids = torch.zeros(40, 5, dtype=torch.long)
    return {"train_x": {"input_ids": ids, "label": ids[:, 0]}, "eval_x": {"input_ids": ids[:8], "label": ids[:8, 0]}}
""",
        {"task": {"data": "usermod:bad_data", "loss": "model"}},
        "prepare",
        ["returned no train_y and train_x has no 'labels' (task.label_key)", "put the targets in train_x under task.label_key"],
    ),
    "label_key missing from a Dataset item": (
        DATA + """
class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return {"input_ids": torch.zeros(5, dtype=torch.long), "target": torch.tensor(0)}
def bad_data(**_):
    ids = torch.zeros(8, 5, dtype=torch.long)
    return {"train_x": Items(), "eval_x": {"input_ids": ids}, "eval_y": torch.zeros(8, dtype=torch.long)}
""",
        {"task": {"data": "usermod:bad_data"}},
        "prepare",
        ["training item 0 has no 'labels' (task.label_key)", "put the target there or set task.label_key"],
    ),
    "forward drawing from numpy": (
        DATA + """
import numpy
class Noisy(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) + torch.from_numpy(numpy.random.standard_normal(x.shape[0])).float()[:, None]
def bad_model(**_):
    return Noisy(4, 3)
""",
        {"task": {"model": "usermod:bad_model"}, "acceptance": {"min_quality": None}},  # else the 2-step reference's quality
        "freeze",
        ["task.model usermod:bad_model: the model's forward is not deterministic", "differ by", "at output 'output'",
         "training=self.training"],
    ),
    "forward drawing from numpy on batches above two rows": (
        DATA + """
import numpy
class Noisy(torch.nn.Linear):
    def forward(self, x):
        noise = numpy.random.standard_normal(x.shape[0]) if x.shape[0] > 2 else numpy.zeros(x.shape[0])
        return super().forward(x) + torch.from_numpy(noise).float()[:, None]
def bad_model(**_):
    return Noisy(4, 3)
""",
        {"task": {"model": "usermod:bad_model"}, "acceptance": {"min_quality": None}},
        "freeze",
        ["task.model usermod:bad_model: the model's forward is not deterministic", "over the fixed set's first batch",
         "at output 'output'"],
    ),
    "training drawing from numpy's unseeded generator": (
        DATA + """
import numpy
class Masked(torch.nn.Linear):
    def forward(self, x):
        if self.training:  # a training augmentation from numpy's global generator, which no torch seed reaches
            x = x * torch.from_numpy(numpy.random.rand(*x.shape) > 0.2).float()
        return super().forward(x)
def bad_model(**_):
    return Masked(4, 3)
""",
        {"task": {"model": "usermod:bad_model"}, "acceptance": {"min_quality": None}},
        "freeze",
        ["task.model usermod:bad_model: the FP32 reference's training does not reproduce itself", "first at step 1's loss",
         "in tensor 'weight'", "seed the generator the model draws from"],
    ),
    "min_quality outside the metric's range": (
        DATA,
        {"task": {"kind": "regression", "loss": "mse"}, "acceptance": {"min_quality": 0.9}},
        "prepare",
        ["acceptance.min_quality 0.9 is outside the range", "task.metric neg_rmse", "use a value in that range"],
    ),
}


def project(dest: Path, source: str, override: dict) -> Path:
    dest.mkdir(parents=True)
    shutil.copytree(ROOT / "pipeline", dest / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "usermod.py").write_text(textwrap.dedent(source))
    params = read_params()  # YAML 1.2, as the stages read it (`compile: off` is a word)
    base = {"task": {"model": "usermod:build_model", "data": "usermod:load_data"}, "prepare": {"ordinary_cases": 8},
            "reference": {"train_steps": 2, "batch_size": 8, "checkpoint_every": 1, "replicates": 0},
            "acceptance": {"loss_noise_multiple": None, "loss_noise_atol": None}}
    (dest / "params.yaml").write_text(yaml.safe_dump(merge(merge(params, base), override), sort_keys=False))
    return dest


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_model_input_is_one_line_exit_2_nothing_written(tmp_path, name):
    source, override, failing_stage, words = CASES[name]
    repo = project(tmp_path / "repo", source, override)
    env = env_for(repo)
    if failing_stage == "freeze":
        run([sys.executable, "-m", "pipeline", "prepare"], repo, env=env)
    before = files_under(repo / "data")
    proc = run([sys.executable, "-m", "pipeline", failing_stage], repo, check=False, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert files_under(repo / "data") == before  # nothing written: no reference, no resume state


def test_a_batchnorm_model_in_train_mode_at_inference_reaches_a_verdict(tmp_path):
    """reference.eval_mode: false on a conv net with BatchNorm, which cannot take one row in train mode: freeze's probe
    takes it (issue 48), and a real `dvc repro` reaches a decision."""
    from conftest import make_project
    from _project import dvc

    repo = make_project(tmp_path / "repo", {
        "task": {"model": "pipeline.examples.convnet:build_model", "data": "pipeline.examples.convnet:load_data",
                 "options": {"width": 4}},
        "reference": {"eval_mode": False, "train_steps": 4, "batch_size": 16},
        "trial": {"variants": ["bfloat16"]},
        "acceptance": {"min_quality": None},
    })
    dvc(repo, "repro", "decide@bfloat16")
    decision = yaml.safe_load((repo / "data/decision/bfloat16/decision.json").read_text())
    assert decision["decision"] in {"accept", "rollback"}
