"""The task contract: the user's model and data functions, and their outputs as named tensors."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.config import TaskConfig
from pipeline.errors import UserError

DEFAULT_OUTPUT = "output"


@dataclass
class TaskData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    eval_ids: list[str]


def resolve(entry: str, key: str) -> Callable[..., Any]:
    """Import ``module:function``.

    Raises:
        UserError: the module does not import or lacks the function.
    """
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"params.yaml: {key} {entry!r}: module {module_name!r} does not import ({exc}); "
            f"check the name and that it is on PYTHONPATH"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"params.yaml: {key} {entry!r}: {module_name} has no function {func_name!r}; fix the name")
    return func


def load_data(cfg: TaskConfig) -> TaskData:
    """Call the data function and check what it returns.

    Raises:
        UserError: a key is missing, a tensor is empty or non-finite, or lengths disagree.
    """
    raw = resolve(cfg.data, "task.data")(**cfg.options)
    if not isinstance(raw, dict):
        raise UserError(f"task.data {cfg.data} returned {type(raw).__name__}; return a dict with train_x, train_y, eval_x, eval_y")
    for key in ("train_x", "train_y", "eval_x", "eval_y"):
        value = raw.get(key)
        if not torch.is_tensor(value):
            raise UserError(f"task.data {cfg.data} returned no tensor {key!r}; return train_x, train_y, eval_x, eval_y as tensors")
        if value.shape[0] == 0:
            raise UserError(f"task.data {cfg.data}: {key} is empty; the fixed set needs at least one sample")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise UserError(f"task.data {cfg.data}: {key} holds NaN or inf; clean the data before freezing a reference")
    for split in ("train", "eval"):
        if raw[f"{split}_x"].shape[0] != raw[f"{split}_y"].shape[0]:
            raise UserError(f"task.data {cfg.data}: {split}_x and {split}_y have different lengths; give one target per sample")
    n_eval = raw["eval_x"].shape[0]
    ids = raw.get("eval_ids") or [f"sample-{i:05d}" for i in range(n_eval)]
    if len(ids) != n_eval or len(set(ids)) != n_eval:
        raise UserError(f"task.data {cfg.data}: eval_ids must be {n_eval} distinct strings, one per eval sample")
    return TaskData(
        train_x=raw["train_x"].float(),
        train_y=raw["train_y"],
        eval_x=raw["eval_x"].float(),
        eval_y=raw["eval_y"],
        eval_ids=[str(i) for i in ids],
    )


def build_model(cfg: TaskConfig, seed: int) -> torch.nn.Module:
    """Seeded construction, so the initial weights are a function of ``seed`` alone."""
    torch.manual_seed(seed)
    model = resolve(cfg.model, "task.model")(**cfg.options)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"task.model {cfg.model} returned {type(model).__name__}; return a torch.nn.Module")
    return model


def named_outputs(result: Any, entry: str = "task.model") -> dict[str, torch.Tensor]:
    """``model(x)`` may return a tensor or a dict of named tensors; always give a dict.

    Raises:
        UserError: the model returned something else.
    """
    if torch.is_tensor(result):
        return {DEFAULT_OUTPUT: result}
    if isinstance(result, dict) and result and all(torch.is_tensor(v) for v in result.values()):
        return {str(k): v for k, v in sorted(result.items())}
    raise UserError(f"{entry} returned {type(result).__name__}; return a tensor or a dict of named tensors")


def primary(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output that decisions and the loss are computed from: ``output``, or the first by name."""
    return outputs.get(DEFAULT_OUTPUT, next(iter(outputs.values())))


def check_outputs(outputs: dict[str, torch.Tensor], kind: str, rows: int, targets: torch.Tensor, entry: str) -> None:
    """Refuse outputs that cannot be compared or decided on, before any training is spent on them.

    Raises:
        UserError: wrong number of rows, classification scores not [N, C>=2], or targets out of range.
    """
    for name, value in outputs.items():
        if value.shape[:1] != (rows,):
            raise UserError(f"task.model {entry}: output '{name}' has shape {tuple(value.shape)} for a batch of {rows}; return one row per sample")
        if not value.is_floating_point():
            raise UserError(f"task.model {entry}: output '{name}' is {value.dtype}; return floating-point scores or values")
    scores = primary(outputs)
    if kind == "classification":
        if scores.ndim != 2 or scores.shape[1] < 2:
            raise UserError(
                f"task.model {entry}: classification needs scores of shape [N, classes>=2], got {tuple(scores.shape)}; "
                f"return one score per class, or set task.kind: regression"
            )
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= scores.shape[1]):
            raise UserError(f"task.data: targets range over {int(targets.min())}..{int(targets.max())} but the model scores {scores.shape[1]} classes; make them agree")
    elif scores.reshape(rows, -1).shape[1] != targets.reshape(targets.shape[0], -1).shape[1]:
        raise UserError(f"task.model {entry}: output has {scores.reshape(rows, -1).shape[1]} value(s) per sample but targets have {targets.reshape(targets.shape[0], -1).shape[1]}; make them agree")
