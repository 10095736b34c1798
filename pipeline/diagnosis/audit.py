"""The "AMP engaged" audit: did the variant's matmul, convolution and attention work run in reduced precision?

"bf16 does nothing" reports (pytorch#112329, ROCm/tensorflow-upstream#3067) come from work autocast never saw: a
custom op outside its lists, a forward that computes in float64 or under ``torch.autocast(enabled=False)``, a model
already cast with ``.to(bfloat16)`` (its FP32 reference is then no FP32 at all). One training pass (forward, loss,
backward) under the policy, recorded from below autocast (``precision_map.Recorder``), gives each matmul-like op
with its shapes, precision and FLOPs; the same pass without autocast gives the reference's share. The variant is
flagged when what the policy adds is below ``UNSUPPORTED_BELOW`` of the FLOPs: its speedup claim is unsupported.

Compile does not change which dtype autocast picks, so a compiled variant is audited eager (``Policy.eager``). A
float8 variant is audited on the model as the trial runs it, its linear layers already converted.

``of_trial`` is what trial@NAME writes (``data/trial/NAME/audit.json``): the trained reference weights, as the trial
ran them, on the first micro-batch of the reference's first update (the batch the diagnosis probe reads too).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeline import precision, recipe, task, training
from pipeline.artifacts.audit import UNSUPPORTED_BELOW, Audit, AuditedOp, Share
from pipeline.config import Params, Policy
from pipeline.diagnosis.precision_map import Loss, ModuleScope, Recorder, forward_backward, same_rng
from pipeline.task import Inputs, rows

REDUCED_PRECISIONS = ("float16", "bfloat16", "float8")


def category(op: str) -> str:
    """matmul, convolution or attention, from the aten op's name."""
    if "attention" in op:
        return "attention"
    return "convolution" if "conv" in op else "matmul"


def audit(
    model: torch.nn.Module,
    x: Inputs,
    y: torch.Tensor | None,
    loss_fn: Loss | None,
    policy: Policy,
    device: torch.device,
    threshold: float = UNSUPPORTED_BELOW,
) -> Audit:
    """The audit of one training pass (an inference pass without ``y``) under ``policy``, and of the same pass of
    the FP32 reference. ``model``: the FP32 model (FSDP2's mixed precision casts a copy of it here,
    ``precision.param_cast``). Leaves the model's gradients and the RNG as it found them."""
    ops = _trace(precision.param_cast(model, policy), x, y, loss_fn, policy.eager, device)
    reference = None
    if policy.float8 == "off":
        reference = _total(_trace(model, x, y, loss_fn, Policy(), device)).reduced_share or 0.0
    return _audit(ops, policy, rows(x), reference, threshold)


def of_trial(module: torch.nn.Module, source: task.TrainSource, params: Params, policy: Policy, device: torch.device) -> Audit:
    """The trial's audit: ``module`` is the eager model as the trial ran it (``transforms.Applied.module``: its float8
    layers converted), in train mode from here on; ``source`` the reference's training data."""
    x, y = source.batch(training.update_batches(len(source), params.reference, params.seed)[0][0])
    model = module.to(device).train()
    return audit(model, task.to_device(x, device), y.to(device), recipe.make_loss(params.task), policy, device)


def _trace(model, x, y, loss_fn, policy: Policy, device: torch.device) -> list[AuditedOp]:
    """Every matmul-like op of one pass under ``policy``, by (phase, module, op, precision, shapes)."""
    model.zero_grad(set_to_none=True)
    scope = ModuleScope(model)
    scope.on_input = lambda name, tensors: _back_to_parent(scope, name, tensors)
    recorder = Recorder(scope, watch_nonfinite=False)
    with same_rng(), scope, recorder:
        forward_backward(model, x, y, loss_fn, policy, device, scope)
    model.zero_grad(set_to_none=True)
    total = sum(r.flops for r in recorder.calls.values())
    ops = [
        AuditedOp(
            phase=phase,
            module=module,
            module_type=scope.types.get(module, ""),
            op=op,
            category=category(op),
            precision=precision,
            shapes=shapes,
            count=row.count,
            flops=row.flops,
            share=row.flops / total if total else 0.0,
            by_policy=_under(module, policy.fp32_modules),
        )
        for (phase, module, op, precision, shapes), row in recorder.calls.items()
    ]
    return ops


def _back_to_parent(scope: ModuleScope, name: str, tensors: list[torch.Tensor]) -> None:
    """Once the gradient of a module's input is computed, its backward is over: the ops that follow are its
    parent's own code (a float64 matmul in the model's forward), unless a sibling's output gradient hook, which
    fires first on the same tensor, already named that sibling. ``ModuleScope`` alone would keep the module."""

    def done(grad: torch.Tensor) -> None:
        current = scope.backward_module
        if name and (current == name or current.startswith(name + ".")):
            scope.backward_module = name.rpartition(".")[0]

    for t in tensors:
        if t.requires_grad:
            t.register_hook(done)


def _under(module: str, fp32_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") or m == "" for m in fp32_modules)


def _total(ops: list[AuditedOp]) -> Share:
    flops = sum(o.flops for o in ops)
    reduced = sum(o.flops for o in ops if o.precision in REDUCED_PRECISIONS)
    return Share(flops=flops, reduced_flops=reduced, reduced_share=reduced / flops if flops else None)


def _by(ops: list[AuditedOp], field: str) -> dict[str, Share]:
    keys = sorted({getattr(o, field) for o in ops})
    return {k: _total([o for o in ops if getattr(o, field) == k]) for k in keys}


def _largest_first(ops: list[AuditedOp]) -> tuple[AuditedOp, ...]:
    # Forward first among equals: its module is exact, a backward op's is the last module a gradient reached.
    return tuple(sorted(ops, key=lambda o: (-o.flops, o.phase != "forward", o.phase, o.module, o.op, o.shapes)))


def _audit(ops: list[AuditedOp], policy: Policy, batch: int, reference: float | None, threshold: float) -> Audit:
    total = _total(ops)
    wide = [o for o in ops if o.precision not in REDUCED_PRECISIONS and o.flops]
    expects = policy.amp or policy.float8 != "off" or policy.fsdp_param_dtype is not None  # FSDP2's casts too
    gained = (total.reduced_share or 0.0) - (reference or 0.0)
    flagged = expects and (not total.flops or gained < threshold)
    stayed = _largest_first([o for o in wide if not o.by_policy])
    audit = Audit(
        policy=policy.as_dict(),
        batch=batch,
        threshold=threshold,
        total=total,
        by_category=_by(ops, "category"),
        by_phase=_by(ops, "phase"),
        by_precision={k: s.flops for k, s in _by(ops, "precision").items()},
        reference_reduced_share=reference,
        stayed_fp32=stayed,
        kept_fp32=_largest_first([o for o in wide if o.by_policy]),
        uncounted=tuple(sorted({o.op for o in ops if not o.flops})),
        expects_reduced=expects,
        flagged=flagged,
        speedup_claim="not a precision claim" if not expects else "unsupported" if flagged else "supported",
        line="",
    )
    return replace(audit, line=_line(audit))


def _pct(share: float | None) -> str:
    return f"{100 * (share or 0.0):.1f} %"


def _line(a: Audit) -> str:
    """The report's sentence: the share, what it means for the speedup, and the largest op left in FP32."""
    share = _pct(a.total.reduced_share)
    biggest = f"; largest in FP32: {_describe(a.stayed_fp32[0])}" if a.stayed_fp32 else ""
    if a.kept_fp32:
        kept = sorted({o.module for o in a.kept_fp32})
        biggest += f"; kept in FP32 by fp32_modules {kept}: {_pct(sum(o.share for o in a.kept_fp32))}"
    if not a.expects_reduced:
        return f"the policy runs FP32 by design (no autocast dtype, no float8): {share} of the FLOPs in reduced precision"
    if not a.total.flops:
        return "no matmul, convolution or attention FLOPs were seen: precision has nothing to speed up; speedup claim unsupported"
    if a.flagged and a.reference_reduced_share:
        return (
            f"the FP32 reference already runs {_pct(a.reference_reduced_share)} of the matmul, convolution and attention "
            f"FLOPs in reduced precision (a model cast with .to()?): the policy adds "
            f"{_pct((a.total.reduced_share or 0.0) - a.reference_reduced_share)}; speedup claim unsupported"
        )
    if a.flagged:
        return (
            f"AMP did not engage: only {share} of the matmul, convolution and attention FLOPs ran in reduced precision "
            f"(below {_pct(a.threshold)}){biggest}; speedup claim unsupported"
        )
    kinds = ", ".join(f"{k} {_pct(v / a.total.flops)}" for k, v in a.by_precision.items() if k in REDUCED_PRECISIONS)
    return f"AMP engaged: {share} of the matmul, convolution and attention FLOPs ran in reduced precision ({kinds}){biggest}"


def _describe(op: AuditedOp) -> str:
    shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in op.shapes)
    where = f"module {op.module!r}" if op.module else "the model's own forward"
    return f"{op.op} {shapes} {op.precision} in {where}, {op.phase}, {_pct(op.share)}"
