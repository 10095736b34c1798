"""The model probe, before any training is spent on the user's model: two training samples and the fixed set's first batch
through it (``check``), and the reference's first updates run twice (``check_training``)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pipeline import checkpoint, training
from pipeline.config import ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.inference import BATCH_ROWS, INFERENCE_SEED, infer
from pipeline.config import Policy
from pipeline.recipe import make_loss, own_loss
from pipeline.vetting import MASKING
from pipeline.task import (IGNORE_INDEX, Inputs, TensorSource, TrainSource, call, check_outputs, iter_rows, named_outputs,
                           primary, rows, to_device)


def check(model: torch.nn.Module, source: TrainSource, task_cfg: TaskConfig, device: torch.device, eval_mode: bool,
          compiled: Sequence[str] = (), fixed: Inputs | None = None) -> bool:
    """Run the model on two training samples, and on the first alone: it must take the inputs, give outputs that can be
    compared whatever the batch (``check_batch_free``), and (``loss: model``) compute its own loss. Then the fixed set's
    first batch (``fixed``: its inputs; else the two samples), as every inference pass batches it (``BATCH_ROWS`` rows
    from ``INFERENCE_SEED``, in the reference's mode ``eval_mode``), twice: the same outputs both times
    (``check_reproducible``). That batch, not a smaller one: a forward that draws from numpy only on batches above two
    rows passed two samples, and an FP32 variant was rolled back on 26 flips of its draws. A third pass from another
    seed tells whether the forward draws (always-on dropout, noise): then no variant may compile (``compiled``: their
    names), as inductor draws other numbers than eager FP32. Why first: a model that does not fit the task contract
    should cost one line, not a training run that fails at its end. Returns whether the model's own loss reads
    per-token labels one position ahead (``labels_shifted``).

    Raises:
        UserError: the model fails on the inputs, or its outputs depend on the batch or differ between two passes, or they
            or its loss do not fit the task, or it draws while a variant compiles.
    """
    x, y = source.batch(torch.arange(min(2, len(source))))
    entry, batch = f"task.model {task_cfg.model}", x
    part = x if fixed is None else next(iter(iter_rows(fixed, BATCH_ROWS)))[2]
    what = "the same training samples" if fixed is None else f"the fixed set's first batch ({rows(part)} cases)"
    try:
        out = infer(model, x, Policy(), device, eval_mode=True)
        if task_cfg.loss == "model":
            with torch.no_grad():
                make_loss(task_cfg)(model, to_device(x, device), y.to(device))
        batch = part
        first = infer(model, part, Policy(), device, eval_mode)
        again = infer(model, part, Policy(), device, eval_mode)
        reseeded = infer(model, part, Policy(), device, eval_mode, seed=INFERENCE_SEED + 1) if compiled else again
    except UserError:
        raise
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as exc:
        shapes = {k or "x": tuple(t.shape) for k, t in (batch.items() if isinstance(batch, dict) else {"": batch}.items())}
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(
            f"{entry} fails on a batch of the prepared data {shapes} ({reason}); make the model take the data "
            f"function's inputs, then `dvc repro`"
        ) from None
    other = _fewer_rows(model, source, device) if rows(x) > 1 else None
    if other is not None:  # before the shapes are read as classes or values
        check_batch_free(out, other, entry)
    check_reproducible(first, again, entry, device, eval_mode, what)
    if compiled and any(_worst(a, reseeded[name], device)[0] for name, a in first.items() if name in reseeded):
        raise UserError(
            f"{entry}: the model's forward draws random numbers at inference ({'eval' if eval_mode else 'train'} mode: "
            f"another seed gives other outputs), and trial variant {compiled[0]!r} compiles it, whose kernels draw other "
            f"numbers than eager FP32's: their difference would be judged as precision's; set compile: off in "
            f"trial.policies.{compiled[0]}, or draw only when self.training"
        )
    targets = source.y if isinstance(source, TensorSource) else y
    check_outputs(out, task_cfg.kind, rows(x), targets, task_cfg.model)
    return labels_shifted(model, source, task_cfg, device)


def _fewer_rows(model: torch.nn.Module, source: TrainSource, device: torch.device) -> dict[str, torch.Tensor] | None:
    """Outputs of the first training sample alone for ``check_batch_free``; of the first three where the model cannot
    take one row, and None where it cannot take those either. In eval mode whatever the reference's: shapes do not
    follow the mode, and there a BatchNorm with running statistics takes one row (in train mode it cannot). Why a model
    that cannot is not refused: a layer that normalises over the batch in every mode (BatchNorm without running
    statistics, ``F.batch_norm(..., training=True)``) is legitimate while no batch of one row reaches it, and three rows
    still show in-batch scores ([B, B])."""
    for n in (1, 3):
        if n >= 3 and len(source) < 3:
            return None
        try:
            return infer(model, source.batch(torch.arange(n))[0], Policy(), device, eval_mode=True)
        except Exception:  # noqa: BLE001 - a model's own error on a batch size it need not take: no check, no refusal
            continue
    return None


def check_batch_free(two: dict[str, torch.Tensor], one: dict[str, torch.Tensor], entry: str) -> None:
    """Refuse an output whose shape past the rows changes with the batch (outputs ``two`` of a batch of 2, ``one`` of
    a batch of 1, or of 3 where the model cannot take one row): in-batch scores, as CLIP's ``logits_per_image`` [B, B]
    compares each image with the batch's texts, make a case's outputs depend on which cases share its batch; a squeezed
    batch dimension breaks at a last batch of 1.

    Raises:
        UserError: naming the output and both shapes."""
    for name, value in two.items():
        other = one.get(name)
        if other is not None and tuple(other.shape[1:]) != tuple(value.shape[1:]):
            raise UserError(
                f"{entry}: output '{name}' has shape {tuple(value.shape)} for a batch of {len(value)} but "
                f"{tuple(other.shape)} for a batch of {len(other)}: one case's outputs must not depend on the batch "
                f"(in-batch scores such as CLIP's logits_per_image, a squeezed batch dimension); return per-sample outputs"
            )


REPEAT_RTOL_GPU = 2.0**-7
"""On a GPU, how far two FP32 passes of a deterministic forward may differ, relative to each value plus its output's
RMS (``check_reproducible``). Kernels that add with atomics or choose their reduction order at run time (scatter_add,
index_add, some convolution and attention kernels) reorder float32 sums; a normalisation after such a sum divides by
a small spread and magnifies its roundoff: a layer_norm of 65,536 reordered messages of mean 1 moved by 3.7e-3 of its
scale (reviewer's probe). 2**-7 (7.8e-3) is twice that, and still a small share of what a drawn difference does (a
dropout mask or a noise draw moves values by a large share of their scale). On the CPU a kernel gives the same bits on
the same thread count: bit equality is required there."""

SLICE = 1 << 20
"""Elements compared at a time: the probe's outputs (an LLM's two samples x positions x vocabulary) are never widened
to float64 whole."""


def _worst(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> tuple[float, int]:
    """The largest difference between two passes' values of one output, and its flat index (0.0, -1 where none): NaN on
    both sides agrees; on a GPU, a difference within ``REPEAT_RTOL_GPU`` of the value plus the output's RMS (masked
    values, at ``vetting.MASKING`` and below, set no scale) is float rounding, not a difference."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    rms = 0.0
    if device.type != "cpu":
        total, count = 0.0, 0
        for s in range(0, fa.numel(), SLICE):
            x = fa[s : s + SLICE].double()
            live = x[x.isfinite() & (x.abs() < -MASKING)]
            total, count = total + float(live.square().sum()), count + live.numel()
        rms = math.sqrt(total / count) if count else 0.0
    worst, where = 0.0, -1
    for s in range(0, fa.numel(), SLICE):
        x, y = fa[s : s + SLICE].double(), fb[s : s + SLICE].double()
        diff = (x - y).abs().masked_fill((x == y) | (x.isnan() & y.isnan()), 0.0).nan_to_num(math.inf)
        if device.type != "cpu":  # float rounding of nondeterministic kernels, not a drawn difference
            diff = diff.masked_fill(diff <= REPEAT_RTOL_GPU * (x.abs() + rms), 0.0)
        if diff.numel() and float(diff.max()) > worst:
            worst, where = float(diff.max()), s + int(diff.argmax())
    return worst, where


def check_reproducible(first: dict[str, torch.Tensor], again: dict[str, torch.Tensor], entry: str, device: torch.device,
                       eval_mode: bool, what: str = "the same training samples") -> None:
    """Refuse a forward whose two FP32 passes over the same inputs, from the same weights and ``INFERENCE_SEED``, differ
    (bit for bit on the CPU; beyond ``REPEAT_RTOL_GPU`` on a GPU): a trial reruns the reference exactly so, and every
    difference such a forward makes (numpy or ``random`` draws, which ``INFERENCE_SEED`` does not seed; state that forward
    changes, a call counter, a cache) would be judged as the precision's, an FP32 trial rolled back on flips its
    precision never caused. torch's own draws (dropout, ``randn_like``) are seeded alike in every pass: they pass.

    Raises:
        UserError: naming the output, the element and the difference, and the fix."""
    worst, how = 0.0, ""
    for name, a in first.items():
        b = again.get(name)
        if b is None or b.shape != a.shape:
            how = f"return output '{name}' as {tuple(a.shape)}, then {'nothing' if b is None else tuple(b.shape)}"
            break
        diff, where = _worst(a, b, device)
        if diff > worst:
            at = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), a.shape))
            worst, how = diff, f"differ by {diff:.4g} at output '{name}' element {at}"
    if not how:
        return
    mode = "eval mode" if eval_mode else "train mode (reference.eval_mode: false)"
    raise UserError(
        f"{entry}: the model's forward is not deterministic: two FP32 passes in {mode} over {what}, same "
        f"weights and seed, {how}, so no trial could reproduce the reference and every difference would be blamed on "
        f"precision; draw randomness only when self.training (F.dropout(x, p, training=self.training)) or from torch's "
        f"global generator (seeded alike in every pass), not numpy, random or a generator of your own, and keep forward "
        f"from changing the model's state"
    )


TRAINING_REPEAT_STEPS = 2
"""Updates ``check_training`` runs twice: the first, where a draw in the forward (a mask, a crop, noise) changes the loss
and the gradient, and one from the state it left (the optimizer's moments, the schedule's first step), where a draw
that starts on the second call shows. More costs updates (4 here, against a reference's 60 by default) and finds no
other kind of draw: an unseeded generator differs on its first use."""


def check_training(model: torch.nn.Module, init: checkpoint.Checkpoint, source: TrainSource, cfg: ReferenceConfig,
                   task_cfg: TaskConfig, device: torch.device, seed: int) -> None:
    """Refuse a reference whose training does not reproduce itself: its first ``TRAINING_REPEAT_STEPS`` FP32 updates
    (the real loop, ``training.train`` stopped there, schedules keeping their span) run twice from the initial state
    ``init`` (weights and torch's RNG), and their losses and the weights they leave must agree: bit for bit on the CPU;
    on a GPU within ``REPEAT_RTOL_GPU`` of each update (reordered sums round differently). Why: a training that draws
    from a generator no seed reaches (numpy's global one, as a Hugging Face Wav2Vec2's SpecAugment masks do) trains
    another reference on every run; six runs of identical params gave bfloat16 rollback, accept, accept, rollback,
    accept, accept. ``model`` is left in ``init`` (weights and torch's RNG): the reference trains as without the check.

    Raises:
        UserError: in one line, naming the first step whose loss differs and the first weight tensor that does, and the
            fix."""
    steps = min(TRAINING_REPEAT_STEPS, cfg.train_steps)
    runs = []
    try:
        for _ in range(2):
            checkpoint.restore(init, model)
            result = training.train(model, source, cfg, task_cfg, Policy(), device, seed, label="freeze FP32 repeated",
                                    stop=steps)
            runs.append(([r.loss for r in result.records], result.state.model_state()))
            del result  # its optimizer state: one run's weights are kept, not two full states
    finally:
        checkpoint.restore(init, model)
    (losses, weights), (losses_again, weights_again) = runs
    start = init.model_state()
    step = next((i for i, (a, b) in enumerate(zip(losses, losses_again)) if not _same_loss(a, b, device)), None)
    where = f"first at step {step + 1}'s loss ({losses[step]!r}, then {losses_again[step]!r})" if step is not None else ""
    for name, a in weights.items():
        b = weights_again[name]
        if device.type != "cpu" and a.is_floating_point():  # the updates, whose scale the GPU's tolerance is read in
            a, b = a - start[name].to(a.dtype), b - start[name].to(b.dtype)
        diff, at = _worst(a, b, device)
        if diff:
            element = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), a.shape))
            where += f"{' and' if where else f'after {steps} updates,'} in tensor '{name}' (by {diff:.4g} at element {element})"
            break
    if not where:
        return
    raise UserError(
        f"task.model {task_cfg.model}: the FP32 reference's training does not reproduce itself: two runs of its first "
        f"{steps} update{'s' * (steps > 1)} from the same weights, seed and batches differ, {where}, so no trial could "
        f"repeat the reference and a verdict would change from run to run; draw training's randomness from torch's global "
        f"generator (seeded alike in every run), or seed the generator the model draws from (numpy's, random's) from "
        f"torch's, or turn that augmentation off for the reference (a Hugging Face Wav2Vec2's SpecAugment: "
        f"mask_time_prob: 0), then `dvc repro`"
    )


def _same_loss(a: float, b: float, device: torch.device) -> bool:
    """Two runs' losses at one step agree: equal (NaN with NaN), or on a GPU within ``REPEAT_RTOL_GPU`` of the first."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    return device.type != "cpu" and abs(a - b) <= REPEAT_RTOL_GPU * abs(a)


def labels_shifted(model: torch.nn.Module, source: TrainSource, task_cfg: TaskConfig, device: torch.device) -> bool:
    """Whether the model's own loss (``loss: model``) scores per-token scores [N, T, C] against the labels one position
    ahead, as a Hugging Face causal LM does (``GPT2LMHeadModel`` and every ``...ForCausalLM`` shift the labels they are
    given: position t predicts token t + 1). Measured, not guessed from a class name: on a few training samples, in
    eval mode, the model's loss is compared with the cross-entropy of its scores against the labels as given and one
    position ahead; ahead must match to float rounding and better than as given. The fixed set is then judged the same
    way (``cases.aligned``): scored against the labels as given, a causal LM predicts none of them."""
    if task_cfg.loss != "model" or task_cfg.kind != "classification":
        return False
    x, y = source.batch(torch.arange(min(8, len(source))))
    if y.ndim != 2 or y.shape[1] < 2 or y.is_floating_point():
        return False
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = call(model, to_device(x, device), **{task_cfg.label_key: y.to(device)})
    finally:
        model.train(was)
    loss = own_loss(result)
    scores = primary(named_outputs(result, f"task.model {task_cfg.model}"))
    if loss is None or scores.ndim != 3 or tuple(scores.shape[:2]) != tuple(y.shape):
        return False
    s, labels, own = scores.double(), y.to(scores.device), float(loss)
    ce = torch.nn.functional.cross_entropy
    as_given = float(ce(s.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX))
    ahead = float(ce(s[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX))
    return abs(own - ahead) < abs(own - as_given) and abs(own - ahead) <= 1e-4 * max(1.0, abs(own))
