"""What really ran in which precision: every aten op of a forward and backward pass, seen from below autocast.

A ``TorchDispatchMode`` sits under autocast and autograd in the dispatcher, so it sees each op after
autocast chose its dtypes and after autograd split the backward into ops of its own. ``ModuleScope``
(forward hooks on every module, and gradient hooks on their outputs) says which module an op ran for.
On top of that one recorder:

- the precision map: op, phase, input and output dtypes, count and FLOPs (matmul-like ops), and the
  share of matmul-like work that ran in reduced precision;
- the matmul trace: each matmul-like op with its module, input shapes, precision (float8 included) and
  FLOPs (``Recorder.calls``, read by the "AMP engaged" audit, ``pipeline.diagnosis.audit``);
- missing kernels: an op without a kernel for the reduced dtype on this device is recorded with its
  name and re-run in float32 so the pass goes on (a finding, not a crash);
- the first non-finite producer: the recorder notes the first op whose output is not finite while its
  inputs are (read by ``pipeline.diagnosis.trace``).

Used by the diagnosis only: these hooks never run in the trial's or the benchmark's code. Every pass
(``forward_backward``) starts with ``precision.strict_fp32()``: the FP32 side of each comparison is exact
FP32, never TF32 (on by default for cuDNN on Ampere and newer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from pipeline import checkpoint, devices, precision
from pipeline.artifacts.diagnosis import (
    FirstNonFinite,
    MatmulSummary,
    MatmulWork,
    MissingKernel,
    OpRow,
    ParameterUnderflow,
    PrecisionMap,
    Underflow,
    UnderflowCounts,
)
from pipeline.config import DTYPES
from pipeline.config import Policy
from pipeline.task import Inputs, call, named_outputs, primary, rows

try:  # FLOP formulas of the ops PyTorch's own FlopCounterMode knows (mm, addmm, bmm, conv, attention)
    from torch.utils.flop_counter import flop_registry as _FLOPS
except ImportError:  # pragma: no cover - older torch: counts only
    _FLOPS = {}
# The CPU attention kernels take the same leading (grad_out,) query, key, value as the GPU ones the registry knows.
_FLOPS_ALIAS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}

REDUCED = tuple(getattr(torch, name) for name in DTYPES)  # config.DTYPES, the autocast dtypes
MATMUL_LIKE = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "convolution",
    "_convolution",
    "convolution_backward",
    "mkldnn_convolution",
    "_addmm_activation",
    "_scaled_mm",
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_precision(tensors: list[torch.Tensor]) -> str:
    """The precision a matmul-like op ran in: ``float8`` when an operand is float8 (a float8 dtype, or a tensor
    subclass such as torchao's ``Float8TrainingTensor`` that advertises its high-precision dtype but carries
    float8 data, real kernels or emulated), else the dtype of the first operand of two or more dimensions
    (addmm's bias and scalars come first or beside; they do not say what the multiply ran in)."""
    if any(_is_float8(t) for t in tensors):
        return "float8"
    main = next((t for t in tensors if t.dim() >= 2), tensors[0] if tensors else None)
    return dtype_name(main.dtype) if main is not None else "none"


def _is_float8(t: torch.Tensor) -> bool:
    if "float8" in str(t.dtype):
        return True
    flatten = getattr(type(t), "__tensor_flatten__", None)  # a wrapper subclass: look at the tensors it holds
    if flatten is None:
        return False
    inner = [getattr(t, name, None) for name in flatten(t)[0]]
    return any(torch.is_tensor(i) and "float8" in str(i.dtype) for i in inner)


def is_matmul_like(op: str) -> bool:
    """``op`` is the overload packet name (``addmm``); attention kernels count as matmul work too."""
    return op in MATMUL_LIKE or "attention" in op or "convolution" in op


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if torch.is_tensor(t) and t.is_floating_point()]


def max_abs(t: torch.Tensor) -> float:
    """Largest finite magnitude (0.0 when none is finite): how close a tensor came to the dtype's limit."""
    t = t.detach()
    if not t.numel():
        return 0.0
    top = t.abs().amax()  # one pass; the masked copy only when something is not finite (same value): 14x at LM scale
    if torch.isfinite(top):
        return float(top)
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


class ModuleScope:
    """Which module is running. Forward: a stack of qualified names kept by pre/post hooks. Backward: the
    module whose output gradient arrived last (its backward ops follow), from gradient hooks on outputs.
    ``on_output(name, module, tensors)``, ``on_output_grad(name, grad)`` and ``on_input(name, tensors)`` let a
    caller watch them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        on_output: Callable[[str, torch.nn.Module, list[torch.Tensor]], None] | None = None,
        on_output_grad: Callable[[str, torch.Tensor], None] | None = None,
        on_input: Callable[[str, list[torch.Tensor]], None] | None = None,
    ) -> None:
        self.model = model
        self.types = {name: type(m).__name__ for name, m in model.named_modules()}
        self.on_output, self.on_output_grad, self.on_input = on_output, on_output_grad, on_input
        self.stack: list[str] = []
        self.backward_module = ""
        self.phase = "forward"
        self._handles: list[Any] = []

    def current(self) -> str:
        if self.phase == "backward":
            return self.backward_module
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> ModuleScope:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._before(n, a)))
            self._handles.append(module.register_forward_hook(lambda m, a, out, n=name: self._after(n, m, out)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, name: str, args: Any) -> None:
        self.stack.append(name)
        if self.on_input is not None:
            self.on_input(name, _floats(args))

    def _after(self, name: str, module: torch.nn.Module, output: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        tensors = _floats(output)
        if self.on_output is not None:
            self.on_output(name, module, tensors)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda g, n=name: self._grad(n, g))

    def _grad(self, name: str, grad: torch.Tensor) -> None:
        # A container returns its last child's tensor: keep the innermost module, not the ancestor.
        current = self.backward_module
        if not (current and (name == "" or current.startswith(name + "."))):
            self.backward_module = name
        if self.on_output_grad is not None:
            self.on_output_grad(name, grad)


# Where a pass's first non-finite value came from, by the phase its op ran in.
_WHERE = {"forward": "module", "loss": "loss", "backward": "gradient"}


@dataclass
class _Tally:
    """The running count of one (phase, module, op, dtypes) key while a pass records: mutable, never leaves the recorder."""

    reduced: bool
    matmul_like: bool
    count: int = 0
    flops: int = 0


class Recorder(TorchDispatchMode):
    """Records every op (see the module docstring). Enter it inside a ``ModuleScope``."""

    def __init__(self, scope: ModuleScope, watch_nonfinite: bool = True) -> None:
        super().__init__()
        self.scope, self.watch_nonfinite = scope, watch_nonfinite
        self.rows: dict[tuple, _Tally] = {}
        self.calls: dict[tuple, _Tally] = {}
        """Matmul-like ops by (phase, module, op, precision, input shapes): the audit's trace."""
        self.missing: list[MissingKernel] = []
        self.first_nonfinite: FirstNonFinite | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", func)
        op = getattr(packet, "__name__", str(func))
        module = self.scope.current()
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            if not devices.missing_kernel(exc):  # the one reading of torch's "no kernel" messages
                raise
            self._missing(func, module, args, kwargs, exc)
            out = _in_float32(func, args, kwargs)
        ins, outs = _floats((args, kwargs)), _floats(out)
        in_dt = ",".join(dtype_name(t.dtype) for t in ins)
        out_dt = ",".join(dtype_name(t.dtype) for t in outs)
        # Reduced: the main operand and the main result in float16/bfloat16 (attention keeps FP32 statistics beside them),
        # or a float8 matmul (its result is in the high-precision dtype).
        reduced = bool(ins) and ins[0].dtype in REDUCED and (not outs or outs[0].dtype in REDUCED)
        matmul_like = is_matmul_like(op)
        flops = _flops(packet, op, args, kwargs, out) if matmul_like else 0
        if matmul_like:
            ran_in = op_precision(ins)
            reduced = reduced or ran_in == "float8"
            shapes = tuple(tuple(t.shape) for t in ins)
            call_row = self.calls.setdefault((self.scope.phase, module, str(func), ran_in, shapes), _Tally(reduced, True))
            call_row.count += 1
            call_row.flops += flops
        key = (self.scope.phase, module, str(func), in_dt, out_dt)
        row = self.rows.setdefault(key, _Tally(reduced, matmul_like))
        row.count += 1
        row.flops += flops
        if self.watch_nonfinite and self.first_nonfinite is None:
            bad = [t for t in outs if not bool(torch.isfinite(t).all())]
            if bad and all(bool(torch.isfinite(t).all()) for t in ins):
                self.first_nonfinite = FirstNonFinite(
                    where=_WHERE[self.scope.phase],
                    phase=self.scope.phase,
                    module=module,
                    module_type=self.scope.types.get(module, ""),
                    op=str(func),
                    input_dtypes=in_dt,
                    output_dtypes=out_dt,
                    max_abs_input=max((max_abs(t) for t in ins), default=0.0),
                    max_abs_finite_output=max(max_abs(t) for t in bad),
                    nonfinite_elements=sum(int((~torch.isfinite(t)).sum()) for t in bad),
                    cast=op == "_to_copy",
                )
        return out

    def _missing(self, func, module: str, args, kwargs, exc: BaseException) -> None:
        dtypes = sorted({dtype_name(t.dtype) for t in _floats((args, kwargs))})
        if not any(m.op == str(func) and m.module == module for m in self.missing):
            message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            self.missing.append(
                MissingKernel(str(func), module, self.scope.types.get(module, ""), self.scope.phase, tuple(dtypes), message)
            )

    def table(self) -> tuple[OpRow, ...]:
        """One row per (phase, op, input dtypes, output dtypes), summed over modules; stable order."""
        merged: dict[tuple, list[_Tally]] = {}
        for (phase, _, op, in_dt, out_dt), row in self.rows.items():
            merged.setdefault((phase, op, in_dt, out_dt), []).append(row)
        return tuple(
            OpRow(*k, sum(r.count for r in rows), sum(r.flops for r in rows), rows[0].reduced, rows[0].matmul_like)
            for k, rows in sorted(merged.items(), key=lambda kv: (kv[0][0] != "forward", kv[0][1:]))
        )

    def matmul_by_module(self) -> dict[str, MatmulWork]:
        """Matmul-like work each module ran itself (forward and backward), and how much in reduced precision."""
        by_module: dict[str, list[_Tally]] = {}
        for (_, module, _, _, _), row in sorted(self.rows.items(), key=lambda kv: kv[0]):
            if row.matmul_like:
                by_module.setdefault(module, []).append(row)
        return {
            module: MatmulWork(
                count=sum(r.count for r in rows),
                reduced_count=sum(r.count for r in rows if r.reduced),
                flops=sum(r.flops for r in rows),
                reduced_flops=sum(r.flops for r in rows if r.reduced),
            )
            for module, rows in by_module.items()
        }


def _flops(packet, op: str, args, kwargs, out) -> int:
    alias = _FLOPS_ALIAS.get(op)
    formula = _FLOPS.get(packet) or (_FLOPS.get(getattr(torch.ops.aten, alias)) if alias else None)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not fit this overload: count the op, not its FLOPs
        return 0


def _in_float32(func, args, kwargs):
    """Re-run an op without a reduced-precision kernel in float32, write back what it mutates, and cast
    its outputs back to the reduced dtype it was called with, so the rest of the pass sees what it expects."""
    reduced = next((t.dtype for t in _floats((args, kwargs)) if t.dtype in REDUCED), torch.float32)

    def up(t):
        return t.float() if torch.is_tensor(t) and t.dtype in REDUCED else t

    args32, kwargs32 = tree_map(up, args), tree_map(up, kwargs)
    out = func(*args32, **kwargs32)
    for i, arg in enumerate(getattr(getattr(func, "_schema", None), "arguments", [])):
        if arg.alias_info is not None and arg.alias_info.is_write:
            source = args[i] if i < len(args) else kwargs.get(arg.name)
            target = args32[i] if i < len(args32) else kwargs32.get(arg.name)
            if torch.is_tensor(source) and source is not target:
                source.copy_(target)
    return tree_map(lambda t: t.to(reduced) if torch.is_tensor(t) and t.dtype == torch.float32 else t, out)


def summarize(recorder: Recorder) -> MatmulSummary:
    """Share of matmul-like work in reduced precision, FLOP-weighted where FLOPs are known, else by count."""
    rows = [r for r in recorder.rows.values() if r.matmul_like]
    flops = sum(r.flops for r in rows)
    reduced_flops = sum(r.flops for r in rows if r.reduced)
    count = sum(r.count for r in rows)
    reduced_count = sum(r.count for r in rows if r.reduced)
    return MatmulSummary(
        matmul_ops=count,
        matmul_ops_reduced=reduced_count,
        matmul_flops=flops,
        matmul_flops_reduced=reduced_flops,
        reduced_share=(reduced_flops / flops) if flops else (reduced_count / count if count else 0.0),
        share_weighted_by="flops" if flops else "count",
    )


Loss = Callable[..., torch.Tensor]
"""``loss(output, target)``, or the task's ``recipe.Loss`` (which may be the model's own ``.loss``)."""


def _forward_and_loss(
    model: torch.nn.Module, x: Inputs, y: torch.Tensor | None, loss_fn: Loss | None, phase: Callable[[str], None]
):
    """The model's named outputs and, with ``y``, the loss, as the task computes it (``phase("loss")`` between
    the two, unless the model computes its own loss inside its forward)."""
    if y is None or loss_fn is None:
        return named_outputs(call(model, x)), None
    if getattr(loss_fn, "of_output", True) is None:  # task.loss: model, the model computes its own loss from the labels
        result = call(model, x, **{loss_fn.label_key: y})
        loss = result.get("loss") if isinstance(result, dict) else getattr(result, "loss", None)
        return named_outputs(result), loss  # less its loss
    outputs = named_outputs(call(model, x))
    phase("loss")
    return outputs, getattr(loss_fn, "of_output", loss_fn)(primary(outputs), y)


def forward_backward(
    model: torch.nn.Module,
    x: Inputs,
    y: torch.Tensor | None,
    loss_fn: Loss | None,
    policy: Policy,
    device: torch.device,
    scope: ModuleScope | None = None,
    scale: float = 1.0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One pass as the training step does it: autocast (and FP32 regions) around forward and loss only,
    backward of the loss times ``scale`` (what ``GradScaler.scale`` does) after the context closes.
    Without ``y`` it is an inference pass: no loss, no backward, no graph. Strict FP32 first, every time.
    """

    def phase(name: str) -> None:
        if scope is not None:
            scope.phase = name

    precision.strict_fp32()
    phase("forward")
    grad = torch.set_grad_enabled(y is not None)
    with grad, precision.fp32_regions(model, policy, device), precision.autocast(policy, device):
        outputs, loss = _forward_and_loss(model, x, y, loss_fn, phase)
    if loss is not None:
        phase("backward")
        (loss * torch.full((), scale, dtype=torch.float32, device=loss.device)).backward()
    return outputs, loss


@contextlib.contextmanager
def same_rng() -> Iterator[None]:
    """Run from the current RNG state (CPU and every GPU's: checkpoint's one capture) and put it back after."""
    state = checkpoint.rng_state()
    try:
        yield
    finally:
        checkpoint.set_rng_state(state)


def precision_map(model, x, y, loss_fn, policy: Policy, device: torch.device) -> PrecisionMap:
    """The op table of one forward and backward pass under ``policy``, its summary, and missing kernels.

    A pass that stops on an error the float32 fallback cannot get past is reported with the error,
    and the table holds what ran until then.
    """
    model.zero_grad(set_to_none=True)
    scope = ModuleScope(model)
    recorder = Recorder(scope, watch_nonfinite=False)
    error = None
    try:
        with same_rng(), scope, recorder:
            forward_backward(model, x, y, loss_fn, policy, device, scope)
    except (NotImplementedError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0][:200]
        error = f"{type(exc).__name__} in {scope.phase} of module {scope.current()!r}: {first_line}"
    model.zero_grad(set_to_none=True)
    return PrecisionMap(
        dtype=policy.dtype,
        fp32_modules=tuple(policy.fp32_modules),
        batch=rows(x),
        summary=summarize(recorder),
        ops=recorder.table(),
        matmul_by_module=recorder.matmul_by_module(),
        missing_kernels=tuple(recorder.missing),
        error=error,
    )


def gradient_underflow(
    model, x, y, loss_fn, policy: Policy, device: torch.device, scale: float, fallback: bool = False
) -> Underflow:
    """Per parameter: the fraction of gradient elements that are zero under autocast (after unscaling)
    but not in FP32, on the same weights, batch and RNG state, without loss scaling and with ``scale``.
    Elements that overflow (inf/NaN) at that scale are counted apart: the GradScaler would skip that step.
    ``fallback`` runs ops without a reduced-precision kernel in float32 (see ``Recorder``).
    """

    def grads(p: Policy, s: float) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with same_rng():  # dropout draws the same masks in every pass
            if fallback:
                scope = ModuleScope(model)
                with scope, Recorder(scope, watch_nonfinite=False):
                    forward_backward(model, x, y, loss_fn, p, device, scope, scale=s)
            else:
                forward_backward(model, x, y, loss_fn, p, device, scale=s)
        out = {n: (q.grad.detach().float() / s) for n, q in model.named_parameters() if q.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    fp32 = grads(Policy(), 1.0)
    plain, scaled = grads(policy, 1.0), grads(policy, scale)
    rows = tuple(_underflow(name, g32, plain[name], scaled[name]) for name, g32 in fp32.items())

    def total(count: str) -> int:
        return sum(getattr(r, count) for r in rows)

    elements = max(total("elements"), 1)
    totals = UnderflowCounts(
        elements=total("elements"),
        nonzero_fp32=total("nonzero_fp32"),
        vanished_unscaled=total("vanished_unscaled"),
        vanished_scaled=total("vanished_scaled"),
        nonfinite_unscaled=total("nonfinite_unscaled"),
        nonfinite_scaled=total("nonfinite_scaled"),
        fraction_unscaled=total("vanished_unscaled") / elements,
        fraction_scaled=total("vanished_scaled") / elements,
    )
    return Underflow(dtype=policy.dtype, scale=scale, parameters=rows, total=totals)


def _underflow(name: str, g32: torch.Tensor, plain: torch.Tensor, scaled: torch.Tensor) -> ParameterUnderflow:
    """One parameter's gradient elements alive in FP32 that vanished (or overflowed) under autocast."""
    alive = g32 != 0
    vanished_unscaled, vanished_scaled = int((alive & (plain == 0)).sum()), int((alive & (scaled == 0)).sum())
    return ParameterUnderflow(
        parameter=name,
        elements=g32.numel(),
        nonzero_fp32=int(alive.sum()),
        vanished_unscaled=vanished_unscaled,
        vanished_scaled=vanished_scaled,
        nonfinite_unscaled=int((~torch.isfinite(plain)).sum()),
        nonfinite_scaled=int((~torch.isfinite(scaled)).sum()),
        fraction_unscaled=vanished_unscaled / g32.numel(),
        fraction_scaled=vanished_scaled / g32.numel(),
    )
