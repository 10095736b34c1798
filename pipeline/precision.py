"""The precision policy: the one place that knows autocast, GradScaler and FP32 regions.

A policy is a dtype (None for the FP32 reference) and a list of modules kept outside autocast.
Everything else in the pipeline asks this module for contexts and scalers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._pytree import tree_map

from pipeline.errors import UserError

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """Raises: UserError for a dtype autocast does not take here."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class Policy:
    dtype: str | None = None
    """Autocast dtype name, or None for strict FP32."""
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)
    """Qualified names of modules run outside autocast, their floating inputs cast to float32."""

    @property
    def amp(self) -> bool:
        return self.dtype is not None

    @property
    def uses_scaler(self) -> bool:
        # FP16's narrow range needs loss scaling; BF16 has FP32's exponent range and does not.
        return self.dtype == "float16"

    def as_dict(self) -> dict:
        return {"dtype": self.dtype or "float32", "fp32_modules": list(self.fp32_modules)}


def strict_fp32() -> None:
    """FP32 means FP32: no TF32 in matmuls or convolutions (on by default for cuDNN on Ampere and newer).

    Autocast regions are unaffected; the reference and every op left in FP32 by a trial are exact FP32.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def autocast(policy: Policy, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast around forward and loss only; a no-op context for the FP32 reference."""
    if not policy.amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=parse_dtype(policy.dtype))


def make_scaler(policy: Policy, device: torch.device) -> torch.amp.GradScaler:
    """Create once per training run; enabled for float16 only."""
    return torch.amp.GradScaler(device.type, enabled=policy.uses_scaler)


@contextlib.contextmanager
def fp32_regions(model: torch.nn.Module, policy: Policy, device: torch.device) -> Iterator[None]:
    """Run the policy's fp32_modules outside autocast for the duration of the context.

    Raises:
        UserError: a name in fp32_modules is not a submodule of the model.
    """
    if not policy.amp or not policy.fp32_modules:
        yield
        return
    modules = dict(model.named_modules())
    handles = []
    for name in policy.fp32_modules:
        if name not in modules:
            known = ", ".join(n for n in modules if n)[:300]
            raise UserError(f"trial.fp32_modules: {name!r} is not a module of the model; use one of: {known}")
        module = modules[name]
        original = module.forward

        def forward(*args, __original=original, **kwargs):
            with torch.autocast(device_type=device.type, enabled=False):
                args = tuple(_to_fp32(a) for a in args)
                kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
                return __original(*args, **kwargs)

        handles.append((module, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield
    finally:
        for module, own in handles:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _to_fp32(value):
    # Nested inputs too: an LSTM's (h0, c0) left in float16 would meet float32 weights and fail.
    return tree_map(lambda v: v.float() if torch.is_tensor(v) and v.is_floating_point() else v, value)
