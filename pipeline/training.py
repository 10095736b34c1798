"""The training loop shared by the FP32 reference and every AMP trial, and inference on the fixed set.

One loop, so that the reference and the trial differ only by their precision policy: same initial
state, same batches in the same order, same optimizer and schedule. One optimizer update
(``amp_step``) follows the AMP recipe: scaler created once; zero_grad(set_to_none=True); for each of
the ``grad_accumulation`` micro-batches, autocast around forward and loss only and a scaled backward
after the context closes; then ONE ``unscale_`` (after the accumulation), clipping, scaler.step and
scaler.update. An update the scaler skipped does not count as a real update, and the learning-rate
schedule (warmup included) follows real updates only. The loss is computed in float32 or wider, so
targets are never rounded to the autocast dtype.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from pipeline import checkpoint, distributed, precision, task
from pipeline.config import ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.precision import Policy
from pipeline.task import (
    IGNORE_INDEX,
    check_outputs,
    map_floating,
    DatasetSource,
    Inputs,
    TensorSource,
    TrainSource,
    call,
    iter_rows,
    named_outputs,
    primary,
    resolve,
    to_device,
)


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    scale: float
    skipped: bool
    real_updates: int
    lr: float
    nonfinite_grad: bool = False
    """The gradient norm was not finite without a GradScaler to skip it (bfloat16, FP32): the update was not applied."""
    batch_sha256: str = ""
    """sha256 of the bytes of every micro-batch this step read (inputs and targets, as read): the trial and every
    resume compare it with the reference's, so a non-deterministic Dataset cannot pass unseen."""


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Indices of each micro-batch: epochs of seeded permutations, independent of the global RNG."""
    gen = torch.Generator().manual_seed(seed)
    order: list[torch.Tensor] = []
    perm = torch.randperm(n, generator=gen)
    pos = 0
    size = min(batch_size, n)
    while len(order) < steps:
        if pos + size > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        order.append(perm[pos : pos + size])
        pos += size
    return order


def update_batches(n: int, cfg: ReferenceConfig, seed: int) -> list[list[torch.Tensor]]:
    """For each optimizer update, the indices of its ``grad_accumulation`` micro-batches (seeded, fixed)."""
    k = cfg.grad_accumulation
    flat = batch_order(n, cfg.batch_size, cfg.train_steps * k, seed)
    return [flat[i * k : (i + 1) * k] for i in range(cfg.train_steps)]


def batch_digest(micro: list[tuple[Any, torch.Tensor]]) -> str:
    """sha256 of one update's micro-batches as read from the source (host tensors, before any device copy)."""
    named = {}
    for i, (x, y) in enumerate(micro):
        named.update({f"{i}/{name}": t for name, t in task.tensors_of(x).items()})
        named[f"{i}/targets"] = y
    return checkpoint.tensors_digest(named)


def _check_batch(step: int, digest: str, expected: str, what: str) -> None:
    if expected and digest != expected:
        raise UserError(
            f"training step {step + 1}: the batch read differs from {what} (sha256 {digest[:12]}… vs {expected[:12]}…): the "
            f"Dataset or task.data is not deterministic; make __getitem__ a function of its index (seed any augmentation "
            f"from it), then `dvc repro --force`"
        )


def neighbours_swapped(order: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Another data order, the smallest that moves training: in each pair of consecutive updates, the first
    samples of their first micro-batches trade places (same samples, same counts, same batch sizes).

    Why this is the FP32 noise replicate: a training run is judged against how much a harmless change moves
    FP32 itself. A one-ulp change of the weights moves the loss by ~1e-7 (rounding stays rounding over a
    short run), far below what any real change does, so it cannot serve as a gate; another data-order seed
    changes every batch and moves it ~20x more than AMP does on the default example. One swapped sample per
    pair of updates moves it by as much as a reduced precision does (measured: README "Training band")."""
    out = [[b.clone() for b in step] for step in order]
    for s in range(0, len(out) - 1, 2):
        a, b = out[s][0], out[s + 1][0]
        if a.numel() and b.numel():
            first = a[0].clone()
            a[0], b[0] = b[0], first
    return out


def as_source(train_x: Any, train_y: torch.Tensor | None = None) -> TrainSource:
    """Tensors (or a dict of tensors) and targets, or an already built source."""
    if isinstance(train_x, (TensorSource, DatasetSource)):
        return train_x
    return TensorSource(train_x, train_y)


# --- loss -------------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32: a float16 output is widened exactly; a target is never rounded to the autocast dtype."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[N, C] against [N], or per token [N, T, C] against [N, T]; targets of -100 ignored."""
    out = _wide(out)
    if out.ndim == 3:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    if not bool((y != IGNORE_INDEX).any()):
        # Every target ignored (an all-padding micro-batch): the mean would be 0/0 = NaN and look like a
        # diverged step; such a batch adds nothing, as its sum says (0, with zero gradients).
        return F.cross_entropy(out, y.long(), ignore_index=IGNORE_INDEX, reduction="sum")
    return F.cross_entropy(out, y.long(), ignore_index=IGNORE_INDEX)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = _wide(out)
    n = y.shape[0]
    return F.mse_loss(out.reshape(n, -1), y.reshape(n, -1).to(out.dtype))


def loss_function(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output, target)`` for a loss computed from the primary output (not ``model``)."""
    if kind == "cross_entropy":
        return cross_entropy
    if kind == "mse":
        return mse
    if kind == "model":
        raise ValueError("loss 'model' is computed by the model: use make_loss")
    user = resolve(kind, "task.loss")

    def custom(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        value = user(_wide(out), y)  # the user's loss sees float32 too: targets never meet the autocast dtype
        if not torch.is_tensor(value) or value.numel() != 1:
            raise UserError(f"task.loss {kind} returned {type(value).__name__}; return a scalar tensor")
        return _wide(value.reshape(()))

    return custom


class Loss:
    """``loss(model, x, y)``: forward and loss, as the task says (the model's own ``.loss`` included)."""

    def __init__(self, kind: str, label_key: str = "labels", entry: str = "task.model") -> None:
        self.kind, self.label_key, self.entry = kind, label_key, entry
        self.of_output = None if kind == "model" else loss_function(kind)

    def __call__(self, model: torch.nn.Module, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        if self.of_output is not None:
            return self.of_output(primary(named_outputs(call(model, x), self.entry)), y)
        if not torch.is_tensor(x) and self.label_key in x:
            raise UserError(f"task.label_key {self.label_key!r} is also an input name; give the targets as train_y only, or rename one")
        result = call(model, x, **{self.label_key: y})
        loss = getattr(result, "loss", None)
        if loss is None and isinstance(result, dict):
            loss = result.get("loss")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise UserError(
                f"{self.entry} returned no scalar .loss although task.loss is model; make it compute the loss when given "
                f"{self.label_key}=..., or pick another task.loss"
            )
        return _wide(loss.reshape(()))


def make_loss(task: TaskConfig | str) -> Loss:
    if isinstance(task, str):
        return Loss(task)
    return Loss(task.loss, task.label_key, f"task.model {task.model}")


# --- optimizer and schedule ----------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, cfg: ReferenceConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer on ``model.parameters()``.

    Raises:
        UserError: a ``module:function`` factory that does not return an optimizer.
    """
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    optimizer = resolve(cfg.optimizer, "reference.optimizer")(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"reference.optimizer {cfg.optimizer} returned {type(optimizer).__name__}; return a torch.optim.Optimizer "
            f"built on the parameters it is given"
        )
    return optimizer


def lr_factor(cfg: ReferenceConfig, updates: int) -> float:
    """Multiplier of the base learning rate after ``updates`` REAL updates (warmup from 0, then the decay)."""
    s = cfg.lr_schedule
    if updates < s.warmup:
        return updates / s.warmup
    after = updates - s.warmup
    span = max(1, cfg.train_steps - s.warmup)
    if s.kind == "step":
        return s.gamma ** (after // s.every)
    if s.kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(after / span, 1.0)))
    if s.kind == "linear":
        return max(0.0, 1.0 - after / span)
    return 1.0


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: ReferenceConfig):
    """A ``LambdaLR`` stepped once per REAL update; None when the rate is constant."""
    if cfg.lr_schedule.kind == "none" and cfg.lr_schedule.warmup == 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(cfg, u))


# --- one update ------------------------------------------------------------------------------------------


@dataclass
class StepOutcome:
    loss: torch.Tensor
    """Mean loss over the micro-batches (detached, on the device)."""
    grad_norm: torch.Tensor
    """Total gradient norm after unscale_, before clipping."""
    scale: float
    """The GradScaler's scale this update ran with (1.0 without a scaler, or when not read back)."""
    skipped: bool
    """The scaler skipped the optimizer step (inf/NaN gradients); always False when not read back."""
    nonfinite_grad: bool = False
    """No GradScaler and a non-finite gradient norm: the update was not applied (``skipped`` too)."""


def amp_step(
    model: torch.nn.Module,
    micro_batches: list[tuple[Inputs, torch.Tensor]],
    loss_fn: Callable[[torch.nn.Module, Inputs, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    policy: Policy,
    device: torch.device,
    max_norm: float = math.inf,
    params: list[torch.nn.Parameter] | None = None,
    read_back: bool = True,
    apply: bool = True,
) -> StepOutcome:
    """ONE optimizer update, the recipe's: the training loop, the benchmark and the diagnosis all use it.

    ``micro_batches`` are (inputs, targets) already on ``device``; each one's loss is divided by their
    count, so the accumulated gradient is that of the mean loss. Autocast covers forward and loss only;
    backward runs after the context closes; ``unscale_`` runs once, after the last micro-batch, then the
    gradient is clipped to ``max_norm`` and the scaler steps and updates. With ``read_back=False`` nothing
    is read back to the host (the benchmark's timed loop): ``scale`` is 1.0 and ``skipped`` False.
    The caller owns ``scheduler.step()`` (on real updates only, ``not outcome.skipped``).

    Without a GradScaler (bfloat16, FP32) a non-finite gradient norm is never applied: the guide's guard,
    which the scaler provides for float16. ``apply=False`` skips the update as a scaler skip would (the FP32
    run aligned on a trial's skipped updates).
    """
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.get_scale() if read_back and scaler.is_enabled() else 1.0
    n = len(micro_batches)
    total = None
    for x, y in micro_batches:
        with precision.autocast(policy, device):
            loss = loss_fn(model, x, y)
        scaler.scale(loss if n == 1 else loss / n).backward()
        total = loss.detach() if total is None else total + loss.detach()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    mean = total if n == 1 else total / n
    if not apply:
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(loss=mean, grad_norm=grad_norm, scale=float(scale), skipped=True)
    if read_back and not scaler.is_enabled() and not bool(torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(loss=mean, grad_norm=grad_norm, scale=float(scale), skipped=True, nonfinite_grad=True)
    scaler.step(optimizer)
    scaler.update()
    skipped = bool(read_back and scaler.is_enabled() and scaler.get_scale() < scale)
    return StepOutcome(loss=mean, grad_norm=grad_norm, scale=float(scale), skipped=skipped)


@dataclass
class TrainResult:
    records: list[StepRecord]
    real_updates: int
    state: checkpoint.Checkpoint

    @property
    def final_scale(self) -> float:
        """The GradScaler's scale after the last update; 1.0 when no scaler ran (FP32, bfloat16)."""
        return self.state.meta["grad_scaler"].get("scale", 1.0)


@dataclass
class TrialResult:
    outputs: dict[str, torch.Tensor] | None
    """The trained reference's outputs on the fixed set, under the policy (None when streamed to a sink)."""
    training: TrainResult
    """The training repeated from the reference's initial state, under the policy."""
    trained_outputs: dict[str, torch.Tensor] | None
    """Outputs on the fixed set of the model trained under the policy (None when streamed to a sink)."""
    aligned: list[StepRecord] | None = None
    """FP32 from the same start with the trial's skipped updates skipped too (``aligned_fp32``), when it skipped any."""


def run_trial(
    trained: torch.nn.Module,
    make_initial: Callable[[], torch.nn.Module],
    train_x: Any,
    train_y: torch.Tensor | None,
    cases_x: Inputs,
    cfg: ReferenceConfig,
    loss_kind: TaskConfig | str,
    policy: Policy,
    device: torch.device,
    seed: int,
    resume: checkpoint.Checkpoint | None = None,
    save_resume: Callable[[checkpoint.Checkpoint], None] | None = None,
    label: str = "trial",
    sink: Callable[[str, Iterator[dict[str, torch.Tensor]]], None] | None = None,
    expect_batches: list[str] | None = None,
) -> TrialResult:
    """A trial, the one definition trial@DTYPE and the diagnosis's re-runs share.

    Inference with the trained reference weights in the frozen train/eval mode; then training from the
    reference's initial state. ``make_initial`` restores that state (weights and RNG) and is called
    only after the inference, so that nothing the inference draws moves the RNG the training starts from.
    With ``sink``, outputs are streamed chunk by chunk to ``sink("outputs" | "trained_outputs", chunks)``
    instead of being held in memory.
    """

    def outputs(name: str, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        if sink is None:
            return infer(model, cases_x, policy, device, cfg.eval_mode)
        sink(name, infer_chunks(model, cases_x, policy, device, cfg.eval_mode))
        return None

    first = outputs("outputs", trained)
    model = make_initial()
    result = train(model, train_x, train_y, cfg, loss_kind, policy, device, seed, resume=resume, save_resume=save_resume, label=label,
                   expect_batches=expect_batches)
    trained_outputs = outputs("trained_outputs", model)
    aligned = aligned_fp32(make_initial, train_x, train_y, cfg, loss_kind, device, seed, result.records, label)
    return TrialResult(first, result, trained_outputs, aligned)


def aligned_fp32(make_initial, train_x, train_y, cfg: ReferenceConfig, loss_kind, device, seed: int, records: list[StepRecord],
                 label: str) -> list[StepRecord] | None:
    """FP32 trained from the reference's start with the GradScaler's skipped updates skipped too, or None when
    the trial skipped none.

    Why: a skip the scaler makes by design (an overflow, the scale backs off) leaves the trial one update
    behind FP32 for the rest of the run; its per-step loss then differs from the reference's by what one
    update changes, not by precision. Against this run the band measures precision alone, so a healthy
    float16 run with a few skips passes, while a real divergence still fails. Skips due to a non-finite
    gradient without a scaler (``nonfinite_grad``) are failures in themselves and are not aligned."""
    skips = frozenset(r.step for r in records if r.skipped and not r.nonfinite_grad)
    if not skips:
        return None
    model = make_initial()
    return train(model, train_x, train_y, cfg, loss_kind, Policy(), device, seed, label=f"{label} FP32 aligned on skips",
                 skip_steps=skips).records


def train(
    model: torch.nn.Module,
    train_x: Any,
    train_y: torch.Tensor | None,
    cfg: ReferenceConfig,
    loss_kind: TaskConfig | str,
    policy: Policy,
    device: torch.device,
    seed: int,
    resume: checkpoint.Checkpoint | None = None,
    save_resume: Callable[[checkpoint.Checkpoint], None] | None = None,
    label: str = "train",
    skip_steps: frozenset[int] = frozenset(),
    batches: list[list[torch.Tensor]] | None = None,
    stop: int | None = None,
    expect_batches: list[str] | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``cfg.train_steps`` optimizer updates under ``policy``.

    ``train_x`` is a tensor, a dict of tensors (``train_y`` the targets), or a training source (a
    Dataset's, ``train_y`` None). ``loss_kind`` is the task (or a loss name). The caller has already put
    the model in its initial state (weights and RNG). With ``resume``, the loop continues from a saved
    state and ends exactly as if it had never stopped.

    Under torchrun with N > 1 ranks (``pipeline.distributed``), each rank trains on its slice of every
    micro-batch through DistributedDataParallel, records the loss averaged over the ranks, and only rank 0
    saves resume states.

    ``skip_steps``: steps whose update is not applied, as a GradScaler skip (the FP32 run aligned on a trial).
    ``batches``: another order of the micro-batch indices than the seeded one (the FP32 noise replicate).
    ``stop``: end after this many steps of the SAME run (the diagnosis replay): schedules keep their span.
    ``expect_batches``: the reference's per-step ``batch_sha256``; a step that reads other bytes stops the run
    with one line (checked on rank 0, whose shard the reference recorded).
    """
    end = cfg.train_steps if stop is None else min(stop, cfg.train_steps)
    precision.strict_fp32()
    world = distributed.current()
    source = as_source(train_x, train_y)
    model.to(device).train()
    loss_fn = make_loss(loss_kind)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    scaler = precision.make_scaler(policy, device)
    order = batches if batches is not None else update_batches(len(source), cfg, seed)
    records: list[StepRecord] = []
    real_updates = 0
    start = 0
    if resume is not None:
        checkpoint.restore(resume, model, optimizer, scaler, scheduler)
        records = [StepRecord(**r) for r in resume.meta["records"]]
        real_updates = resume.meta["real_updates"]
        start = resume.meta["step"]
        if records and start and world.rank == 0:  # the data read after a resume is the data read before it
            again = [source.batch(world.shard(idx)) for idx in order[start - 1]]
            _check_batch(start - 1, batch_digest(again), records[-1].batch_sha256, "the one recorded before the resume")
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    kill_after = int(os.environ.get("PIPELINE_KILL_AFTER_STEP", "0")) - _KILL_OFFSET[0]
    stop_after = int(os.environ.get("PIPELINE_STOP_AFTER_STEP", "0")) - _KILL_OFFSET[0]
    kill_rank = int(os.environ.get("PIPELINE_KILL_RANK", str(world.rank)))
    if not world.writes:
        save_resume = None
    progress = Progress(label, end, start)
    with precision.fp32_regions(model, policy, device):
        net = world.wrap(model, device)  # the model itself in one process
        for step in range(start, end):
            micro = []
            for idx in order[step]:
                try:
                    x, y = source.batch(world.shard(idx))
                except UserError as exc:  # a bad item of a Dataset: say which training step met it
                    raise UserError(f"training step {step + 1}: {exc}") from None
                micro.append((x, y))
            digest = batch_digest(micro)
            if expect_batches is not None and world.rank == 0 and step < len(expect_batches):
                _check_batch(step, digest, expect_batches[step], "the reference's")
            micro = [(to_device(x, device), y.to(device)) for x, y in micro]
            out = amp_step(net, micro, loss_fn, optimizer, scaler, policy, device, max_norm, params, apply=step not in skip_steps)
            if not out.skipped:
                real_updates += 1
                if scheduler is not None:
                    scheduler.step()
            records.append(
                StepRecord(
                    step=step,
                    loss=float(world.mean(out.loss).item()),
                    grad_norm=float(out.grad_norm.item()),
                    scale=out.scale,
                    skipped=out.skipped,
                    real_updates=real_updates,
                    lr=float(optimizer.param_groups[0]["lr"]),
                    nonfinite_grad=out.nonfinite_grad,
                    batch_sha256=digest,
                )
            )
            progress.tick(step + 1, records[-1].loss, out.scale, sum(r.skipped for r in records))
            every = cfg.checkpoint_every
            if save_resume is not None and every and (step + 1) % every == 0 and step + 1 < end:
                save_resume(_snapshot(model, optimizer, scaler, scheduler, records, real_updates, step + 1, policy))
            if kill_after == step + 1 and kill_rank == world.rank:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection for the kill-and-resume tests
            if stop_after == step + 1 and kill_rank == world.rank:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen here; the test SIGKILLs the stage process from outside
    state = _snapshot(model, optimizer, scaler, scheduler, records, real_updates, end, policy)
    _KILL_OFFSET[0] += end
    return TrainResult(records=records, real_updates=real_updates, state=state)


_KILL_OFFSET = [0]
"""Fault injection: PIPELINE_KILL_AFTER_STEP=K kills the process after step K of its trainings counted one
after the other (freeze: the reference's steps 1..S, then the FP32 replicate's S+1..2S); under torchrun,
PIPELINE_KILL_RANK=R kills rank R only (default: every rank). PIPELINE_STOP_AFTER_STEP=K stops the process
(SIGSTOP) there instead, so that a test can SIGKILL the stage process from outside at a known step."""


def _snapshot(model, optimizer, scaler, scheduler, records, real_updates, step, policy) -> checkpoint.Checkpoint:
    return checkpoint.capture(
        model,
        optimizer,
        scaler,
        scheduler,
        meta={
            "records": [asdict(r) for r in records],
            "real_updates": real_updates,
            "step": step,
            "policy": policy.as_dict(),
        },
    )


# --- inference -------------------------------------------------------------------------------------------


@torch.no_grad()
def infer_chunks(
    model: torch.nn.Module,
    x: Inputs,
    policy: Policy,
    device: torch.device,
    eval_mode: bool,
    batch_size: int = 256,
) -> Iterator[dict[str, torch.Tensor]]:
    """Outputs of ``model`` on ``x`` under ``policy``, one dict of float32 CPU tensors per batch of rows
    (exact for fp16/bf16 values)."""
    precision.strict_fp32()
    model.to(device)
    model.train(not eval_mode)
    with precision.fp32_regions(model, policy, device), inference_rng(eval_mode, device):
        for _, _, part in iter_rows(x, batch_size):
            with precision.autocast(policy, device):
                out = named_outputs(call(model, to_device(part, device)))
            yield {name: value.detach().float().cpu() for name, value in out.items()}


INFERENCE_SEED = 0
"""The random state every inference pass in train mode starts from (``reference.eval_mode: false``)."""


@contextlib.contextmanager
def inference_rng(eval_mode: bool, device: torch.device) -> Iterator[None]:
    """In train mode (dropout on), every inference pass (reference, trial, trained trial, FP64 arbiter) draws
    from the same state, ``INFERENCE_SEED``, so that FP32 against FP32 is identical and a gap is precision's;
    the global RNG is restored afterwards, so inference never moves what training draws next."""
    if eval_mode:
        yield
        return
    cuda = [torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(INFERENCE_SEED)
        yield


def infer(
    model: torch.nn.Module,
    x: Inputs,
    policy: Policy,
    device: torch.device,
    eval_mode: bool,
    batch_size: int = 256,
) -> dict[str, torch.Tensor]:
    """All of ``infer_chunks`` concatenated (small sets)."""
    chunks: dict[str, list[torch.Tensor]] = {}
    for out in infer_chunks(model, x, policy, device, eval_mode, batch_size):
        for name, value in out.items():
            chunks.setdefault(name, []).append(value)
    return {name: torch.cat(parts) for name, parts in chunks.items()}


def probe(model: torch.nn.Module, source: TrainSource, task_cfg: TaskConfig, device: torch.device) -> None:
    """Run the model on two training samples before any training is spent on it: it must take the
    inputs, give outputs that can be compared, and (``loss: model``) compute its own loss.

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
    check_outputs(out, task_cfg.kind, task.rows(x), targets, task_cfg.model)


def fp64_chunks(model: torch.nn.Module, x: Inputs, eval_mode: bool, batch_size: int = 256) -> Iterator[dict[str, torch.Tensor]] | None:
    """The FP64 arbiter's outputs on CPU, chunk by chunk (floating inputs in float64, ids as they are);
    None when the model does not run in float64."""
    try:
        arbiter = copy.deepcopy(model).to("cpu").double()
        arbiter.train(not eval_mode)
        with torch.no_grad(), inference_rng(eval_mode, torch.device("cpu")):
            first_part = next(iter(iter_rows(x, batch_size)), None)
            if first_part is not None:
                named_outputs(call(arbiter, map_floating(first_part[2], torch.Tensor.double)))  # does it run in float64 at all?
    except (RuntimeError, TypeError, NotImplementedError, UserError):
        return None

    def chunks() -> Iterator[dict[str, torch.Tensor]]:
        with torch.no_grad(), inference_rng(eval_mode, torch.device("cpu")):
            for _, _, part in iter_rows(x, batch_size):
                yield {k: v.double().contiguous() for k, v in named_outputs(call(arbiter, map_floating(part, torch.Tensor.double))).items()}

    return chunks()


class Progress:
    """Per-update lines on a terminal (step, loss, loss scale, skipped updates, rate, ETA); silent when
    stderr is not a terminal (DVC logs, CI)."""

    def __init__(self, label: str, total: int, start: int = 0) -> None:
        self.label, self.total, self.start = label, total, start
        self.t0 = time.monotonic()
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def line(self, done: int, loss: float, scale: float, skipped: int, now: float) -> str:
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        return (
            f"{self.label}: step {done}/{self.total} loss {loss:.4f} scale {scale:g} skipped {skipped} "
            f"{rate:.1f} step/s ETA {eta:.0f}s"
        )

    def tick(self, done: int, loss: float, scale: float = 1.0, skipped: int = 0) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.5 and done < self.total:
            return
        self.last = now
        end = "\n" if done == self.total else ""
        # \x1b[K clears the rest of the line: a shorter line ("ETA 9s" after "ETA 10s") leaves no residue.
        print(f"\r{self.line(done, loss, scale, skipped, now)}\x1b[K", end=end, file=sys.stderr, flush=True)
