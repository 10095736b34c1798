"""The recipe: losses in float32 or wider, the schedule on real updates, the optimizer, the model's own loss (CPU)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from pipeline import recipe, task, training
from pipeline.config import LrSchedule, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.config import Policy
from test_training import CPU, TASK, Loud, data  # the loop's own fixtures: forced GradScaler skips



def cfg(**kw):
    return dataclasses.replace(ReferenceConfig(train_steps=8, batch_size=8, lr=0.01, grad_clip=1.0, checkpoint_every=0), **kw)


# --- loss in float32 or wider (issue 12 item 3) -----------------------------------------------------------


class Constant(torch.nn.Module):
    """One weight times an input of 1: under float16 autocast the output is the weight rounded to float16."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.fc.weight.fill_(value)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("target", [300.3, 1.0e5])
def test_targets_are_never_rounded_to_the_autocast_dtype(target):
    """300.3 is 300.25 in float16, so the old loss (target cast to the output's dtype) was exactly 0 for an
    output of 300.25; 1e5 is beyond float16's 65504, so the old loss was inf. Both are wrong."""
    x, y = torch.ones(4, 1), torch.full((4, 1), target)
    out = Constant(300.25)(x).detach().half()  # allowed: a tensor, not a model
    assert float(torch.tensor(target).half()) != target  # allowed: what the old code trained against
    expected = (float(torch.tensor(target)) - 300.25) ** 2  # the float32 target
    loss = recipe.mse(out, y)
    assert loss.dtype == torch.float32
    assert math.isfinite(float(loss)) and float(loss) == pytest.approx(expected, rel=1e-5)
    torch.manual_seed(0)
    regression = TaskConfig(kind="regression", loss="mse")
    result = training.train(
        Constant(300.25), task.TensorSource(x, y), cfg(train_steps=1, batch_size=4), regression, Policy(dtype="float16"), CPU,
        seed=0,
    )
    assert result.records[0].loss == pytest.approx(expected, rel=1e-5)


# --- schedule, optimizer and the model's own loss ------------------------------------------------------


def test_warmup_and_cosine_follow_real_updates_under_forced_skips():
    c = cfg(train_steps=16, lr_schedule=LrSchedule(kind="cosine", warmup=3))
    torch.manual_seed(0)
    result = training.train(Loud(), data(), c, TASK, Policy(dtype="float16"), CPU, seed=0)
    assert sum(r.skipped for r in result.records) >= 3
    for r in result.records:
        assert r.lr == pytest.approx(0.01 * recipe.lr_factor(c, r.real_updates))
    assert recipe.lr_factor(c, 0) == 0 and recipe.lr_factor(c, 3) == 1.0 and recipe.lr_factor(c, 16) == pytest.approx(0.0)
    assert recipe.lr_factor(dataclasses.replace(c, lr_schedule=LrSchedule(kind="linear", warmup=0)), 8) == pytest.approx(0.5)


def test_adamw_with_weight_decay_and_betas():
    opt = recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer="adamw", weight_decay=0.01, betas=[0.8, 0.99]))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.99)


def not_an_optimizer(params):
    return list(params)


def an_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)


def test_optimizer_factory(monkeypatch):
    assert recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer=f"{__name__}:an_optimizer")).param_groups[0]["lr"] == 0.5
    with pytest.raises(UserError, match="returned list; return a torch.optim.Optimizer"):
        recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer=f"{__name__}:not_an_optimizer"))


class OwnLoss(torch.nn.Module):
    """Hugging Face style: targets under ``labels``, the loss on the output object."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def test_loss_model_uses_the_models_own_loss():
    source = data()
    torch.manual_seed(0)
    own = training.train(OwnLoss(), source, cfg(), TaskConfig(loss="model"), Policy(), CPU, seed=0)
    torch.manual_seed(0)
    ours = training.train(OwnLoss(), source, cfg(), TaskConfig(loss="cross_entropy"), Policy(), CPU, seed=0)
    assert [r.loss for r in own.records] == [r.loss for r in ours.records]
    with pytest.raises(UserError, match="no scalar .loss"):
        recipe.make_loss(TaskConfig(loss="model"))(NoLoss(), source.x[:2], source.y[:2])


class NoLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, labels=None):
        return self.fc(x)


# --- all-padding batches and custom losses ------------------------------------------------------------


def test_a_micro_batch_whose_targets_are_all_ignored_adds_zero_not_nan():
    scores = torch.randn(2, 3, 5, requires_grad=True)
    loss = recipe.cross_entropy(scores, torch.full((2, 3), -100))
    loss.backward()
    assert float(loss) == 0.0 and bool((scores.grad == 0).all())
    some = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    assert torch.equal(
        recipe.cross_entropy(scores, some), torch.nn.functional.cross_entropy(scores.reshape(-1, 5), some.reshape(-1))
    )


def test_a_custom_loss_sees_float32_not_the_autocast_dtype():
    training_loss = recipe.loss_function(f"{__name__}:_record_dtype")
    _RECORD[:] = []
    training_loss(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3))
    assert _RECORD == [torch.float32]


_RECORD: list = []


def _record_dtype(out, y):
    _RECORD.append(out.dtype)
    return (out - y).pow(2).mean()
