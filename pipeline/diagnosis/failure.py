"""Where a trial raised under its policy: the op, the module, and the first case or the training step.

trial@NAME runs its policy without hooks. When the model's computation raises (``masked_fill(mask, -1e9)`` under
float16 autocast: "value cannot be converted to type c10::Half without overflow"; ``nn.LSTM`` under float16 on the
CPU, where oneDNN has no float16 LSTM), ``locate`` replays the part that raised once, watched: a
``TorchFunctionMode`` notes the torch function that each exception left (the one the model's own code called:
``torch.Tensor.masked_fill``, ``torch.lstm``) while ``precision_map.ModuleScope`` keeps the stack of running modules.
The variant then gets a failed trial (``pipeline.artifacts.trial.Failure``) and a rollback naming the op, instead of
a traceback that leaves every later variant unjudged.

Not a failure of the policy, and raised as it was: a mistake in params or data (``UserError``), the disk
(``OSError``), memory (``MemoryError``, a GPU out of memory), and an exception the replay does not reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from pipeline import checkpoint, devices, distributed, inference, training
from pipeline.artifacts.trial import Failure
from pipeline.config import Params, Policy
from pipeline.diagnosis.precision_map import ModuleScope
from pipeline.errors import UserError
from pipeline.task import Inputs, take

NOT_THE_MODEL = (UserError, OSError, MemoryError, torch.OutOfMemoryError)
"""Exceptions that say nothing about the policy: they stop the stage as before."""
_WHERE = "_amp_raised_in"
"""The attribute that ``_Watch`` sets on an exception: (op, module) where it was first raised."""


def under_policy(exc: BaseException) -> bool:
    """``exc`` may be the model's computation failing under the policy (the replay decides)."""
    return isinstance(exc, Exception) and not isinstance(exc, NOT_THE_MODEL)


@dataclass(frozen=True)
class Raised:
    """What one watched replay saw raise."""

    op: str
    """The torch function that raised, or "" when the model's own Python code did."""
    module: str
    module_type: str
    error: str
    """The exception's type and the first line of its message."""
    missing_kernel: bool


class _Watch(TorchFunctionMode):
    """Notes, on each exception leaving a torch function, that function and the module running (the first one only:
    the innermost, as the exception goes up). Inside a torch function the mode is off, so the op named is the one the
    model's code called (``torch.nn.functional.multi_head_attention_forward``, not its inner ``baddbmm``)."""

    def __init__(self, scope: ModuleScope) -> None:
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception as exc:
            if not hasattr(exc, _WHERE):
                name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
                # a backward raises in the module whose output gradient arrived last (ModuleScope's gradient hooks)
                module = self.scope.backward_module if name.endswith(".backward") else self.scope.current()
                try:
                    setattr(exc, _WHERE, (name, module))
                except AttributeError:  # an exception type without a __dict__: the module stack still says where
                    pass
            raise


def watched(model: torch.nn.Module, run: Callable[[], Any]) -> Raised | None:
    """Run ``run()`` (some part of the trial, on ``model``) once, watched; where it raised, or None when it ran through.

    Raises:
        Exception: whatever ``run`` raised that is no failure of the model (``NOT_THE_MODEL``).
    """
    with ModuleScope(model) as scope:
        try:
            with _Watch(scope):
                run()
        except Exception as exc:
            if not under_policy(exc):
                raise
            op, module = _where(exc) or ("", scope.current())  # the model's own code raised: the module it was in
            return Raised(op=op, module=module, module_type=scope.types.get(module, type(model).__name__),
                          error=_first_line(exc), missing_kernel=devices.missing_kernel(exc))
    return None


def _where(exc: BaseException) -> tuple[str, str] | None:
    """Where ``exc``, or the exception it was raised from, left a torch function."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if hasattr(exc, _WHERE):
            return getattr(exc, _WHERE)
        exc = exc.__cause__ or exc.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def first_case(model: torch.nn.Module, x: Inputs, policy: Policy, device: torch.device, eval_mode: bool) -> int | None:
    """The first row of ``x`` whose forward raises alone under ``policy`` (unwatched: no hooks), or None when each
    row runs alone (the failure needs the batch)."""
    done = 0
    try:
        for _ in inference.infer_chunks(model, x, policy, device, eval_mode, batch_size=1):
            done += 1
    except Exception as exc:
        if not under_policy(exc):
            raise
        return done
    return None


def inference_raised(make_model: Callable[[], torch.nn.Module], x: Inputs, ids: list[str], policy: Policy,
                     device: torch.device, eval_mode: bool) -> tuple[Raised, str] | None:
    """The trial's inference on the fixed set replayed, watched: what raised, and on which case first (the batch that
    raised, replayed a row at a time); None when it ran through."""
    model, done = make_model(), [0]

    def run() -> None:
        for out in inference.infer_chunks(model, x, policy, device, eval_mode):
            done[0] += next(iter(out.values())).shape[0]

    raised = watched(model, run)
    if raised is None:
        return None
    row = first_case(make_model(), take(x, slice(done[0], None)), policy, device, eval_mode)
    return raised, ids[done[0] + (row or 0)]


def locate(exc: BaseException, part: str, make_trained: Callable[[], torch.nn.Module],
           make_initial: Callable[[], torch.nn.Module], source, x: Inputs, ids: list[str], params: Params, policy: Policy,
           device: torch.device, origin: checkpoint.Checkpoint | None = None) -> Failure | None:
    """The failed trial of ``exc``, raised by ``training.run_trial`` in ``part`` (``trial_tensors.Writer.part``):
    ``inference`` replays the trained reference's inference (``make_trained``), ``training`` the training loop from the
    initial state (``make_initial``, on ``source``) and then the trained model's inference. None when ``exc`` is no
    failure of the model under the policy: not one it could be (``under_policy``), one the replay does not reproduce,
    or a trial on several ranks (whose collectives a one-rank replay cannot join). ``origin``: the optimizer, scheduler
    and GradScaler state the trial's training started from (``reference.checkpoint``).
    """
    if not under_policy(exc) or distributed.current().size > 1:
        return None
    eval_mode = params.reference.eval_mode
    if part == "inference":
        found = inference_raised(make_trained, x, ids, policy, device, eval_mode)
        step = None
    else:
        model, done = make_initial(), [0]

        def replay() -> None:
            training.train(model, source, params.reference, params.task, policy, device, params.seed,
                           label="trial replay, watched", on_step=lambda n: done.__setitem__(0, n), origin=origin)

        raised = watched(model, replay)
        step = done[0] if raised is not None else None  # the steps done before the one that raised: its 0-based index
        # the loop ran through: the trained model's outputs raised
        found = (raised, None) if raised is not None else inference_raised(lambda: model, x, ids, policy, device, eval_mode)
    if found is None:
        return None
    raised, case = found
    return Failure(part=part, error=raised.error, missing_kernel=raised.missing_kernel, op=raised.op, module=raised.module,
                   module_type=raised.module_type, dtype=policy.dtype, device=device.type, case=case, step=step)
