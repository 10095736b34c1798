"""The model probe: two training samples through the user's model before any training is spent on it."""

from __future__ import annotations

import torch

from pipeline.config import TaskConfig
from pipeline.errors import UserError
from pipeline.inference import infer
from pipeline.config import Policy
from pipeline.recipe import make_loss
from pipeline.task import TensorSource, TrainSource, check_outputs, rows, to_device


def check(model: torch.nn.Module, source: TrainSource, task_cfg: TaskConfig, device: torch.device) -> None:
    """Run the model on two training samples: it must take the inputs, give outputs that can be compared,
    and (``loss: model``) compute its own loss. Why first: a model that does not fit the task contract
    should cost one line, not a training run that fails at its end.

    Raises:
        UserError: the model fails on the inputs, or its outputs or loss do not fit the task.
    """
    x, y = source.batch(torch.arange(min(2, len(source))))
    shapes = {k or "x": tuple(t.shape) for k, t in (x.items() if isinstance(x, dict) else {"": x}.items())}
    entry = f"task.model {task_cfg.model}"
    try:
        out = infer(model, x, Policy(), device, eval_mode=True)
        if task_cfg.loss == "model":
            with torch.no_grad():
                make_loss(task_cfg)(model, to_device(x, device), y.to(device))
    except UserError:
        raise
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(
            f"{entry} fails on a batch of the prepared data {shapes} ({first}); make the model take the data "
            f"function's inputs, then `dvc repro`"
        ) from None
    targets = source.y if isinstance(source, TensorSource) else y
    check_outputs(out, task_cfg.kind, rows(x), targets, task_cfg.model)
