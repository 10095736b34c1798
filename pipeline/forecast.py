"""The FP16 headroom forecast, computed from the FP32 reference model on a few training batches.

Each batch runs one FP32 training pass (forward, loss, backward, no autocast, no loss scaling) with module hooks
(``precision_map.ModuleScope``): the largest input and output of every module, the gradient of every leaf
module's output, and every parameter's gradient. It is conservative: every activation and gradient is taken as
float16, although autocast keeps some ops (softmax, norms, the loss) in float32. The records, the file and the
check against the trial are ``pipeline.artifacts.forecast``'s.

``of_reference`` is what freeze writes (``data/reference/forecast.json``): the forecast at the reference's initial
weights and at its trained weights, on the first micro-batch of its first ``BATCHES`` updates, at the initial scale of
the GradScaler a float16 trial creates (``precision.make_scaler``).

API:
    forecast(model, batches, loss_fn, device, initial_scale=65536.0) -> Forecast
    of_reference(params, initial, trained, source, device) -> Headroom
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from pipeline import checkpoint, precision, recipe, task, training
from pipeline.artifacts.forecast import (
    FP16_MAX,
    FP16_SMALLEST_SUBNORMAL,
    TOO_MANY_FP32,
    UNDERFLOW_LIMIT,
    Forecast,
    GradientHeadroom,
    Headroom,
    ModuleHeadroom,
    headroom,
)
from pipeline.config import Params, Policy
from pipeline.diagnosis.precision_map import Loss, ModuleScope, forward_backward, max_abs, same_rng
from pipeline.task import Inputs

BATCHES = 4
"""Updates whose first micro-batch the forecast reads: a few, as the GradScaler's first steps see them; each is one FP32
pass per end of the reference's training, a fraction of its own steps."""
_BINADES = 192  # halvings counted up to this many: 2**192 covers any finite float32 against 65504


@dataclass
class _Gradients:
    """Running counts of gradient elements at the initial scale, and a histogram by binade above 2**-24 (scaled),
    from which the underflow after any number of halvings follows. Mutable, never leaves this module."""

    scale: float
    elements: int = 0
    nonzero: int = 0
    max_abs: float = 0.0
    overflow: int = 0
    binades: torch.Tensor = field(default_factory=lambda: torch.zeros(_BINADES + 1, dtype=torch.int64))
    """Bin 0: below 2**-24 at the initial scale; bin j: in [2**(j-25), 2**(j-24)), the last one open above."""

    def add(self, grad: torch.Tensor) -> None:
        """Count one gradient where it lies: copied to the host, a GPU-sized model's activation gradients (gigabytes a
        batch) took minutes of one CPU thread and of PCIe; only the ``binades`` counts come back."""
        g = grad.detach().float().abs().flatten()
        self.elements += grad.numel()
        if g.numel() and not math.isfinite(float(g.sum())):  # some element is not finite (or the sum overflowed)
            g = g[torch.isfinite(g)]
        nonzero = int(torch.count_nonzero(g))
        self.nonzero += nonzero
        self.max_abs = max(self.max_abs, float(g.max()) if nonzero else 0.0)  # g >= 0: the largest live element
        self.overflow += int((g * self.scale > FP16_MAX).sum())
        self.binades += binades_of(g, self.scale, nonzero).cpu()

    def underflow(self, halvings: int) -> int:
        """Live elements below 2**-24 at the initial scale halved ``halvings`` times."""
        return int(self.binades[: halvings + 1].sum())

    def record(self, halvings: int) -> GradientHeadroom:
        return GradientHeadroom(
            elements=self.elements,
            nonzero=self.nonzero,
            max_abs=self.max_abs,
            underflow_initial=self.underflow(0),
            overflow_initial=self.overflow,
            underflow_settled=self.underflow(halvings),
        )


def binades_of(g: torch.Tensor, scale: float, nonzero: int) -> torch.Tensor:
    """Counts by ``_Gradients.binades``'s bins of the nonzero elements of ``g`` (finite, >= 0) at ``scale``: bin
    floor(log2(v * scale / 2**-24)) + 1, clamped to [0, _BINADES]. For a power-of-two scale (the GradScaler's) it is
    the float32 exponent field shifted, exactly (float32 subnormals and zeros fall in bin 0; the zeros are taken out
    again): 10x faster than the float64 log2 of every element (65e6 gradients, one thread), which any other scale takes."""
    mantissa, exponent = math.frexp(scale)
    if mantissa == 0.5 and exponent <= 102:  # scale = 2**(exponent - 1); a subnormal's bin, exponent - 103 < 0, clamps to 0
        key = torch.bitwise_right_shift(g.view(torch.int32), 23).add_(exponent - 1 + 25 - 127).clamp_(0, _BINADES)
        counts = torch.bincount(key, minlength=_BINADES + 1)
        counts[0] -= g.numel() - nonzero
        return counts
    live = g[g > 0]
    above = torch.floor(torch.log2(live.double() * scale / FP16_SMALLEST_SUBNORMAL)) + 1
    return torch.bincount(above.clamp(0, _BINADES).long(), minlength=_BINADES + 1)


def halvings_to_fit(largest: float, scale: float) -> int:
    """How many times the GradScaler halves ``scale`` before ``largest`` times it fits float16 (65504)."""
    if largest * scale <= FP16_MAX:
        return 0
    return min(math.ceil(math.log2(largest * scale / FP16_MAX)), _BINADES)


def forecast(
    model: torch.nn.Module,
    batches: Sequence[tuple[Inputs, torch.Tensor]],
    loss_fn: Loss,
    device: torch.device,
    initial_scale: float = 65536.0,
) -> Forecast:
    """The forecast from FP32 passes over ``batches`` (inputs and targets on ``device``), with the model in the mode
    the caller left it (train, as the trial trains). ``initial_scale``: the GradScaler's, ``get_scale()`` before its
    first step. Leaves the model's gradients and the RNG as it found them."""
    inputs: dict[str, float] = {}
    outputs: dict[str, float] = {}
    leaves = {name for name, m in model.named_modules() if next(m.children(), None) is None}
    params = {name: _Gradients(initial_scale) for name, p in model.named_parameters() if p.requires_grad}
    activations = _Gradients(initial_scale)
    largest_activation_grad = 0.0

    def on_input(name: str, tensors: list[torch.Tensor]) -> None:
        inputs[name] = max([inputs.get(name, 0.0)] + [max_abs(t) for t in tensors])

    def on_output(name: str, module: torch.nn.Module, tensors: list[torch.Tensor]) -> None:
        outputs[name] = max([outputs.get(name, 0.0)] + [max_abs(t) for t in tensors])

    def on_output_grad(name: str, grad: torch.Tensor) -> None:
        nonlocal largest_activation_grad
        largest_activation_grad = max(largest_activation_grad, max_abs(grad))
        if name in leaves:
            activations.add(grad)

    for x, y in batches:
        model.zero_grad(set_to_none=True)
        scope = ModuleScope(model, on_output=on_output, on_output_grad=on_output_grad, on_input=on_input)
        with same_rng(), scope:
            forward_backward(model, x, y, loss_fn, Policy(), device, scope)
        for name, p in model.named_parameters():
            if p.grad is not None and name in params:
                params[name].add(p.grad)
    model.zero_grad(set_to_none=True)
    return _forecast(model, batches, inputs, outputs, params, activations, largest_activation_grad, initial_scale)


def _totals(parts: list[_Gradients], scale: float) -> _Gradients:
    total = _Gradients(scale)
    for part in parts:
        total.elements += part.elements
        total.nonzero += part.nonzero
        total.max_abs = max(total.max_abs, part.max_abs)
        total.overflow += part.overflow
        total.binades += part.binades
    return total


def _innermost(names: list[str]) -> tuple[str, ...]:
    """The names none of whose submodules is also listed ("" is the model itself, above every other)."""
    return tuple(n for n in names if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names))


def _forecast(model, batches, inputs, outputs, params, activations, largest_activation_grad, scale) -> Forecast:
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    modules = {
        name: ModuleHeadroom(
            type=types[name],
            max_abs_input=inputs.get(name, 0.0),
            max_abs_output=outputs.get(name, 0.0),
            beyond_fp16=max(inputs.get(name, 0.0), outputs.get(name, 0.0)) > FP16_MAX,
        )
        for name in types
        if name in outputs
    }
    beyond = _innermost([n for n, m in modules.items() if m.beyond_fp16])
    loudest = max(modules, key=lambda n: (modules[n].max_abs_output, n), default="")
    grads = _totals(list(params.values()), scale)
    halvings = halvings_to_fit(max(grads.max_abs, largest_activation_grad), scale)
    all_elements = max(grads.elements + activations.elements, 1)
    live = max(grads.nonzero, 1)
    layers = [m for m in model.modules() if next(m.children(), None) is None and next(m.parameters(False), None) is not None]
    forecast = Forecast(
        initial_scale=scale,
        batches=len(batches),
        largest_activation=modules[loudest].max_abs_output if modules else 0.0,
        largest_activation_module=loudest,
        modules=modules,
        beyond_fp16=beyond,
        parameter_gradients=grads.record(halvings),
        activation_gradients=activations.record(halvings),
        parameters={name: g.record(halvings) for name, g in params.items()},
        underflow_fraction=grads.underflow(0) / live,
        overflow_fraction=(grads.overflow + activations.overflow) / all_elements,
        halvings=halvings,
        settled_scale=scale / 2**halvings,
        underflow_fraction_settled=grads.underflow(halvings) / live,
        recommendation="",
        fp32_modules=(),
        line="",
    )
    return _recommend(forecast, len(layers))


def _recommend(f: Forecast, layers: int) -> Forecast:
    """The recommendation and its sentence: bf16 when FP16's range cannot hold the model, else the FP32 regions it
    needs, else safe."""
    scaled = f"scale {f.settled_scale:g}"
    if f.halvings:
        scaled += f" (the GradScaler halves {f.initial_scale:g} {f.halvings} times)"
    if "" in f.beyond_fp16:
        why = "the model's own forward (outside any submodule) makes values beyond 65504"
    elif len(f.beyond_fp16) > TOO_MANY_FP32 * layers:
        why = f"{len(f.beyond_fp16)} of its {layers} layers have activations beyond 65504 ({list(f.beyond_fp16)})"
    elif f.underflow_fraction_settled > UNDERFLOW_LIMIT:
        why = f"{100 * f.underflow_fraction_settled:.1f} % of the gradient elements underflow float16 even at {scaled}"
    else:
        why = ""
    if why:
        return replace(f, recommendation="use bf16", line=f"use bf16: {why}")
    if f.beyond_fp16:
        return replace(
            f,
            recommendation="fp16 needs fp32_modules",
            fp32_modules=f.beyond_fp16,
            line=f"fp16 needs fp32_modules {list(f.beyond_fp16)}: their activations reach "
            f"{max(max(f.modules[m].max_abs_input, f.modules[m].max_abs_output) for m in f.beyond_fp16):.3g}, beyond 65504",
        )
    return replace(
        f,
        recommendation="fp16 is safe",
        line=f"fp16 is safe: largest activation {f.largest_activation:.3g} (module {f.largest_activation_module!r}), "
        f"{100 * f.underflow_fraction_settled:.2f} % of the gradient elements underflow at {scaled}",
    )


def of_reference(
    params: Params, initial: checkpoint.Checkpoint, trained: checkpoint.Checkpoint, source: task.TrainSource,
    device: torch.device,
) -> Headroom:
    """The forecast at the reference's ``initial`` and ``trained`` states, each on a model of its own in train mode (the
    reference's model keeps its buffers: a BatchNorm pass in train mode would move them). Leaves the RNG as it found
    it, so that what freeze does next draws what it drew before."""
    with same_rng():
        order = training.update_batches(len(source), params.reference, params.seed)[:BATCHES]
        batches = [source.batch(update[0]) for update in order]
        batches = [(task.to_device(x, device), y.to(device)) for x, y in batches]
        scale = precision.make_scaler(Policy(dtype="float16"), device).get_scale()
        ends = []
        for state in (initial, trained):
            model = task.build_model(params.task, params.seed)
            checkpoint.restore(state, model, rng=False)
            ends.append(forecast(model.to(device).train(), batches, recipe.make_loss(params.task), device, scale))
    return headroom(*ends)
