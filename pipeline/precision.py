"""The precision policy: the one place that knows autocast, GradScaler, FP32 regions and FSDP2's mixed precision.

A policy (``config.Policy``) is an autocast dtype (float32 for the reference) and a list of modules kept
outside autocast; its compiler and float8 parts are applied by ``pipeline.transforms``. Everything else in the
pipeline asks this module for contexts and scalers.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Iterator

import torch
from torch.utils._pytree import tree_map

from pipeline.config import DTYPES, Policy
from pipeline.errors import UserError

_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # the names autocast takes here: config.DTYPES


def parse_dtype(name: str) -> torch.dtype:
    """Raises: UserError for a dtype autocast does not take here."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


# --- TF32: the one switch -------------------------------------------------------------------------------
#
# torch >= 2.9 has a per-backend ``fp32_precision`` ("ieee" or "tf32"); older torch has ``allow_tf32``. Once
# anything in the process (a user's model module, a library) has used the new API, merely READING a legacy
# flag raises "you have used mix of the legacy and new APIs" (torch 2.13). So where the new API exists this
# module reads and writes it only, and never touches a legacy flag; elsewhere it uses the legacy flags.

_NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv")


def _tf32_switches() -> list[tuple[object, str]]:
    """The (object, attribute) pairs that decide TF32 for FP32 matmuls, convolutions and cuDNN RNNs."""
    if _NEW_TF32_API:
        out = [(torch.backends.cuda.matmul, "fp32_precision"), (torch.backends.cudnn.conv, "fp32_precision")]
        if hasattr(torch.backends.cudnn, "rnn"):
            out.append((torch.backends.cudnn.rnn, "fp32_precision"))
        return out
    return [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]


def tf32_state() -> tuple:
    """The current TF32 settings, opaque: give them back to ``set_tf32_state``."""
    return tuple(getattr(obj, name) for obj, name in _tf32_switches())


def set_tf32_state(state: tuple) -> None:
    for (obj, name), value in zip(_tf32_switches(), state):
        setattr(obj, name, value)


def set_tf32(enabled: bool) -> None:
    """Allow (True) or forbid (False) TF32 in FP32 matmuls, convolutions and cuDNN RNNs, on every GPU."""
    value = ("tf32" if enabled else "ieee") if _NEW_TF32_API else bool(enabled)
    set_tf32_state(tuple(value for _ in _tf32_switches()))


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """``set_tf32(enabled)`` for the duration of the context, the previous settings restored after."""
    saved = tf32_state()
    set_tf32(enabled)
    try:
        yield
    finally:
        set_tf32_state(saved)


def strict_fp32() -> None:
    """FP32 means FP32: no TF32 in matmuls or convolutions (on by default for cuDNN on Ampere and newer).

    Autocast regions are unaffected; the reference and every op left in FP32 by a trial are exact FP32.
    """
    set_tf32(False)


# --- determinism ------------------------------------------------------------------------------------------

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS needs a fixed workspace per stream for reproducible results (CUDA >= 10.2)."""
_NOT_DETERMINISTIC = re.compile(r"^(.*?) does not have a deterministic implementation")


def nondeterministic_op(exc: BaseException | str) -> str | None:
    """The op named by torch's "X does not have a deterministic implementation" error or warning, else None."""
    match = _NOT_DETERMINISTIC.match(str(exc).strip())
    return match.group(1).strip() if match else None


def nondeterministic_message(ops: list[str]) -> str:
    """The one line that reports ops with no deterministic kernel, and what to do."""
    return (
        f"reference.deterministic: torch has no deterministic kernel on this device for {', '.join(ops)}; replace "
        f"that op in the model, or set reference.deterministic: false (GPU results may then vary from run to run)"
    )


class deterministic:
    """Deterministic kernels only, or the defaults back (``enabled=False``).

    Applies at once: ``torch.use_deterministic_algorithms``, ``CUBLAS_WORKSPACE_CONFIG`` (set when unset; it
    must be in place before cuBLAS starts, so call this before the first GPU matmul), ``cudnn.deterministic``
    on and ``cudnn.benchmark`` off (no autotuner picking kernels by timing).

    Called as a function, it stays in force, and the first op with no deterministic kernel raises torch's
    RuntimeError (``python -m pipeline`` turns it into one line). Used as a context manager, such ops only
    warn while it runs; on exit every op met is reported in ONE line (``UserError``) and the settings are
    restored.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self._saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        )
        self._warnings: contextlib.AbstractContextManager | None = None
        self._record: list = []
        self._apply(warn_only=False)

    def _apply(self, warn_only: bool) -> None:
        if self.enabled:
            if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
            _use_deterministic(True, warn_only)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        else:
            _use_deterministic(False, False)
            torch.backends.cudnn.deterministic = False

    def __enter__(self) -> deterministic:
        if self.enabled:
            self._apply(warn_only=True)
            self._warnings = warnings.catch_warnings(record=True)
            self._record = self._warnings.__enter__()
            warnings.simplefilter("always")
        return self

    def __exit__(self, typ, exc, tb) -> None:
        ops: list[str] = []
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            for w in self._record:
                op = nondeterministic_op(str(w.message))
                if op is None:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # not ours: pass it on
                elif op not in ops:
                    ops.append(op)
        mode, warn_only, cudnn_det, cudnn_bench = self._saved
        _use_deterministic(mode, warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench
        op = nondeterministic_op(exc) if isinstance(exc, RuntimeError) else None
        if op is not None and op not in ops:
            ops.append(op)
        if ops and (exc is None or op is not None):
            raise UserError(nondeterministic_message(ops)) from None


def _use_deterministic(mode: bool, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms``, only when it changes something: since torch 2.6 each call imports
    Inductor's config (a second of start-up, in every stage that trains)."""
    current = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if current != (mode, mode and warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def autocast(policy: Policy, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast around forward and loss only; a no-op context for the FP32 reference."""
    if not policy.amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=parse_dtype(policy.dtype))


def make_scaler(policy: Policy, device: torch.device) -> torch.amp.GradScaler:
    """Create once per training run; enabled for float16 only (autocast's, or FSDP2's parameters')."""
    return torch.amp.GradScaler(device.type, enabled=policy.uses_scaler)


def fsdp_mixed_precision(policy: Policy) -> tuple[dict, dict]:
    """The arguments of FSDP2's ``MixedPrecisionPolicy`` for the blocks and for the root (``({}, {})``: none, FP32) under
    a policy with ``fsdp_param_dtype``: parameters cast to it, gradients reduced in ``fsdp_reduce_dtype``, and at the root
    the outputs cast to float32, so that the loss is computed in FP32, as autocast computes it."""
    if policy.fsdp_param_dtype is None:
        return {}, {}
    reduce = policy.fsdp_reduce_dtype  # float32 too: config.Policy's Literal, not autocast's DTYPES
    block = {"param_dtype": parse_dtype(policy.fsdp_param_dtype), "reduce_dtype": reduce and getattr(torch, reduce)}
    return block, {**block, "output_dtype": torch.float32}


def param_cast(model: torch.nn.Module, policy: Policy) -> torch.nn.Module:
    """``model`` as ``policy`` runs its forward in one process: itself, or for FSDP2's mixed precision a copy whose
    parameters are in ``fsdp_param_dtype`` (buffers stay as they are, as FSDP2 leaves them), its floating inputs cast to
    that dtype and its outputs to float32, as ``fsdp_mixed_precision`` has the root do. The trial's inference and audit run
    it on rank 0, where nothing is sharded; module names stay the model's."""
    if policy.fsdp_param_dtype is None:
        return model
    import copy

    dtype = parse_dtype(policy.fsdp_param_dtype)
    copied = copy.deepcopy(model)
    for param in copied.parameters():
        param.data = param.data.to(dtype)

    def cast(to):
        return lambda v: v.to(to) if torch.is_tensor(v) and v.is_floating_point() else v

    copied.register_forward_pre_hook(lambda _, args, kwargs: (tree_map(cast(dtype), args), tree_map(cast(dtype), kwargs)),
                                     with_kwargs=True)
    copied.register_forward_hook(lambda _, args, out: tree_map(cast(torch.float32), out))
    return copied


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
            raise UserError(f"fp32_modules: {name!r} is not a module of the model; use one of: {known}")
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
        # Reverse order: each wrapper saved what was there before it, so the last installed goes first.
        for module, own in reversed(handles):
            if own is None:
                del module.forward
            else:
                module.forward = own


def _to_fp32(value):
    # Nested inputs too: an LSTM's (h0, c0) left in float16 would meet float32 weights and fail.
    return tree_map(lambda v: v.float() if torch.is_tensor(v) and v.is_floating_point() else v, value)
