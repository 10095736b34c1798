"""Every variant gets a verdict (issue 48), through a real `dvc repro`: a model that raises under float16 autocast
(attention masked with ``masked_fill(mask, -1e9)``) and one that has no float16 kernel on the CPU (``nn.LSTM``) each
give float16 a rollback naming the op and the module, bfloat16 its verdict by the rule, and `dvc repro` exits 0.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from _project import dvc
from conftest import make_project

pytestmark = pytest.mark.integration

MODELS = """
import torch

def load_data(**_):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, 4, generator=g)
    y = (x[:, :, 0].mean(1) > 0).long()
    return {"train_x": x[:64], "train_y": y[:64], "eval_x": x[64:], "eval_y": y[64:]}

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    def forward(self, h):
        scores = self.q(h) @ self.k(h).transpose(1, 2)
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device).triu(1)
        return scores.masked_fill(causal, -1e9).softmax(-1) @ h

class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
    def forward(self, h):
        return h + self.attention(h)

class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.ModuleList([Layer()])

class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.encoder, self.head = torch.nn.Linear(4, 8), Encoder(), torch.nn.Linear(8, 2)
    def forward(self, x):
        h = self.embed(x)
        for layer in self.encoder.layer:
            h = layer(h)
        return self.head(h.mean(1))

class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = torch.nn.LSTM(4, 8, batch_first=True), torch.nn.Linear(8, 2)
    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])

def build_model(kind="masked", **_):
    torch.manual_seed(0)
    return Masked() if kind == "masked" else Recurrent()
"""

CASES = {  # task.options.kind -> what float16's rollback must name: the part, op, module, and the case or step
    "masked": ("inference", "op torch.Tensor.masked_fill of module 'encoder.layer.0.attention' (Attention) on case ",
               "value cannot be converted to type c10::Half without overflow",
               "trial.policies.float16.fp32_modules: [encoder.layer.0.attention]"),
    "lstm": ("inference", "has no float16 kernel on cpu in op torch.lstm of module 'lstm' (LSTM) on case ",
             "could not create a primitive descriptor for the LSTM", "trial.policies.float16.fp32_modules: [lstm]"),
}


def read(repo, path):
    return json.loads((repo / path).read_text())


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_variant_that_raises_is_rolled_back_naming_the_op_and_the_other_is_judged(tmp_path, kind):
    repo = make_project(tmp_path / "repo", {
        "task": {"model": "usermod:build_model", "data": "usermod:load_data", "options": {"kind": kind}},
        "reference": {"replicates": 0},
        "acceptance": {"min_quality": 0.3, "loss_noise_multiple": None, "loss_noise_atol": None},
        "trial": {"variants": ["float16", "bfloat16"]},
    })
    (repo / "usermod.py").write_text(textwrap.dedent(MODELS))
    made = dvc(repo, "repro")  # exits 0, or raises with its output
    assert "FAILED under its policy" in made.stdout, made.stdout[-3000:]

    part, where, error, fix = CASES[kind]
    failure = read(repo, "data/trial/float16/failure.json")
    assert failure["part"] == part and failure["case"].startswith("ordinary/"), failure
    assert sorted(p.name for p in (repo / "data/trial/float16").iterdir()) == ["failure.json", "manifest.json"]
    assert read(repo, "data/compare/float16/failed.json") == failure

    f16 = read(repo, "data/decision/float16/decision.json")
    assert (f16["decision"], f16["inference"], f16["training"]) == ("rollback", "rollback", "rollback")
    [reason] = f16["reasons"]
    assert reason.startswith(f"{part}: the model ") and where + failure["case"] in reason, reason
    assert error in reason and fix in reason, reason
    assert f16["cases"] == {"raised": [failure["case"]]} and f16["findings"], f16
    assert (repo / "data/decision/float16/rollback/manifest.json").is_file()
    assert read(repo, "data/metrics/float16.json") == {"decision": "rollback", "reasons": 1}
    assert read(repo, "data/benchmark/float16/benchmark.json")["benchmarked"] is False

    bf16 = read(repo, "data/decision/bfloat16/decision.json")  # judged by the rule: its checks ran, whatever the verdict
    assert bf16["checks"] and not any("raised" in r for r in bf16["reasons"]), bf16
    assert (repo / "data/compare/bfloat16/stats.json").is_file() and (repo / "data/report/plots/bfloat16/loss.png").is_file()
    assert not (repo / "data/report/plots/float16").exists()
