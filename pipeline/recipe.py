"""The training recipe from params: the loss the task names, the optimizer, and the learning-rate schedule.

The reference, every trial, the diagnosis's replays and the benchmark build them here, so that they all
train with the same recipe and differ only by their precision policy. The loss is computed in float32 or
wider, so that targets are never rounded to the autocast dtype.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline.config import ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.task import IGNORE_INDEX, Inputs, call, named_outputs, primary, resolve

# --- loss -------------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32: a float16 output is widened exactly; a target is never rounded to the autocast dtype."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[N, C] against [N], or per token [N, T, C] against [N, T]; targets of -100 ignored."""
    out = _wide(out)
    if out.ndim == 3:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    if not bool((y != IGNORE_INDEX).any()):
        # Every target ignored (an all-padding micro-batch): the mean would be 0/0 = NaN and look like a
        # diverged step; such a batch adds nothing, as its sum says (0, with zero gradients).
        return F.cross_entropy(out, y.long(), ignore_index=IGNORE_INDEX, reduction="sum")
    return F.cross_entropy(out, y.long(), ignore_index=IGNORE_INDEX)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = _wide(out)
    n = y.shape[0]
    return F.mse_loss(out.reshape(n, -1), y.reshape(n, -1).to(out.dtype))


def loss_function(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output, target)`` for a loss computed from the primary output (not ``model``)."""
    if kind == "cross_entropy":
        return cross_entropy
    if kind == "mse":
        return mse
    if kind == "model":
        raise ValueError("loss 'model' is computed by the model: use make_loss")
    user = resolve(kind, "task.loss")

    def custom(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        value = user(_wide(out), y)  # the user's loss sees float32 too: targets never meet the autocast dtype
        if not torch.is_tensor(value) or value.numel() != 1:
            raise UserError(f"task.loss {kind} returned {type(value).__name__}; return a scalar tensor")
        return _wide(value.reshape(()))

    return custom


class Loss:
    """``loss(model, x, y)``: forward and loss, as the task says (the model's own ``.loss`` included)."""

    def __init__(self, kind: str, label_key: str, entry: str) -> None:
        self.kind, self.label_key, self.entry = kind, label_key, entry
        self.of_output = None if kind == "model" else loss_function(kind)

    def __call__(self, model: torch.nn.Module, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        if self.of_output is not None:
            return self.of_output(primary(named_outputs(call(model, x), self.entry)), y)
        if not torch.is_tensor(x) and self.label_key in x:
            raise UserError(
                f"task.label_key {self.label_key!r} is also an input name; give the targets as train_y only, or rename one"
            )
        result = call(model, x, **{self.label_key: y})
        loss = own_loss(result)
        if loss is None:
            raise UserError(
                f"{self.entry} returned no scalar .loss although task.loss is model; make it compute the loss when given "
                f"{self.label_key}=..., or pick another task.loss"
            )
        return _wide(loss.reshape(()))


def own_loss(result) -> torch.Tensor | None:
    """The scalar loss a model returned with its outputs (``.loss``, or ``["loss"]`` of a dict), else None."""
    loss = getattr(result, "loss", None)
    if loss is None and isinstance(result, dict):
        loss = result.get("loss")
    return loss if torch.is_tensor(loss) and loss.numel() == 1 else None


def make_loss(task: TaskConfig) -> Loss:
    """The task's loss: ``task.loss`` on the primary output, or the model's own (targets under ``task.label_key``)."""
    return Loss(task.loss, task.label_key, f"task.model {task.model}")


# --- optimizer and schedule ----------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, cfg: ReferenceConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer on ``model.parameters()``.

    Raises:
        UserError: a ``module:function`` factory that does not return an optimizer.
    """
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    optimizer = resolve(cfg.optimizer, "reference.optimizer")(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"reference.optimizer {cfg.optimizer} returned {type(optimizer).__name__}; return a torch.optim.Optimizer "
            f"built on the parameters it is given"
        )
    return optimizer


def lr_factor(cfg: ReferenceConfig, updates: int) -> float:
    """Multiplier of the base learning rate after ``updates`` REAL updates (warmup from 0, then the decay)."""
    s = cfg.lr_schedule
    if updates < s.warmup:
        return updates / s.warmup
    after = updates - s.warmup
    span = max(1, cfg.train_steps - s.warmup)
    if s.kind == "step":
        return s.gamma ** (after // s.every)
    if s.kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(after / span, 1.0)))
    if s.kind == "linear":
        return max(0.0, 1.0 - after / span)
    return 1.0


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: ReferenceConfig) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A ``LambdaLR`` stepped once per REAL update; None when the rate is constant."""
    if cfg.lr_schedule.kind == "none" and cfg.lr_schedule.warmup == 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(cfg, u))
