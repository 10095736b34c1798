"""The first non-finite value of one pass, down to the op and module that made it from finite inputs.

``trace`` runs one watched forward and backward (the precision map's recorder and module scope), with each
module's largest output magnitude and the parameters whose gradients are non-finite after unscaling;
``finite`` says whether a traced pass stayed finite, ``culprit`` which module to keep outside autocast.
"""

from __future__ import annotations

import math

import torch

from pipeline.artifacts.diagnosis import FirstNonFinite, ModuleStat, Trace
from pipeline.diagnosis.precision_map import ModuleScope, Recorder, forward_backward, max_abs
from pipeline.config import Policy
from pipeline.task import tensors_of, to_device


def trace(model, x, y, loss_fn, policy: Policy, device: torch.device, scale: float = 1.0) -> Trace:
    """One watched pass: per-module output magnitudes, the first op that made a non-finite value from
    finite inputs (with its module), and which parameter gradients are non-finite after unscaling."""
    modules: dict[str, ModuleStat] = {}

    def on_output(name: str, module: torch.nn.Module, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        seen = modules.get(name, ModuleStat(type(module).__name__, "", 0.0, True))
        modules[name] = ModuleStat(
            type=seen.type,
            dtype=",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})),
            max_abs=max(seen.max_abs, max(max_abs(t) for t in tensors)),
            finite=seen.finite and all(bool(torch.isfinite(t).all()) for t in tensors),
        )

    model.zero_grad(set_to_none=True)
    scope = ModuleScope(model, on_output=on_output)
    recorder = Recorder(scope)
    x = to_device(x, device)
    with scope, recorder:
        target = y.to(device) if y is not None else None
        outputs, loss = forward_backward(model, x, target, loss_fn, policy, device, scope, scale)
    bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad / scale).all())]
    model.zero_grad(set_to_none=True)
    x_finite = all(bool(torch.isfinite(t).all()) for t in tensors_of(x).values() if t.is_floating_point())
    return Trace(
        policy=policy.as_dict(),
        scale=scale,
        input_finite=x_finite,
        outputs_finite=all(bool(torch.isfinite(v).all()) for v in outputs.values()),
        loss=float(loss.detach()) if loss is not None else None,
        gradients_finite=None if loss is None else not bad_grads,
        nonfinite_gradients=tuple(bad_grads),
        first=recorder.first_nonfinite if x_finite else FirstNonFinite("input"),
        modules=dict(sorted(modules.items())),
        missing_kernels=tuple(recorder.missing),
    )


def finite(t: Trace) -> bool:
    return (
        t.input_finite
        and t.outputs_finite
        and (t.loss is None or math.isfinite(t.loss))
        and t.gradients_finite is not False
    )


def culprit(t: Trace) -> str | None:
    """The module to run outside autocast: the one whose forward (or backward) made the first non-finite value."""
    first = t.first
    if first is None or first.where not in ("module", "gradient") or not first.module:
        return None
    return first.module
