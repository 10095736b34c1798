"""The training loop shared by the FP32 reference and every AMP trial, and the trial that runs it.

One loop, so that the reference and the trial differ only by their precision policy: same initial
state, same batches in the same order, same recipe (``pipeline.recipe``). One optimizer update
(``amp_step``) follows the AMP recipe: scaler created once; zero_grad(set_to_none=True); for each of
the ``grad_accumulation`` micro-batches, autocast around forward and loss only and a scaled backward
after the context closes; then ONE ``unscale_`` (after the accumulation), clipping, scaler.step and
scaler.update. An update the scaler skipped does not count as a real update, and the learning-rate
schedule (warmup included) follows real updates only.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from pipeline import checkpoint, distributed, paths, precision, task, transforms
from pipeline.artifacts.steps import StepRecord
from pipeline.config import Params, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.inference import infer, infer_chunks
from pipeline.config import Policy
from pipeline.recipe import make_loss, make_optimizer, make_scheduler
from pipeline.task import Inputs, TrainSource, to_device


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
    """For each optimizer update, the indices of its ``grad_accumulation`` micro-batches (seeded, fixed).

    An inference-only run (``train_steps`` 0) still draws its first update, never trained on: the batch the audit and
    the diagnosis's probe read (``train`` runs ``train_steps`` of them)."""
    k, steps = cfg.grad_accumulation, max(cfg.train_steps, 1)
    flat = batch_order(n, cfg.batch_size, steps * k, seed)
    return [flat[i * k : (i + 1) * k] for i in range(steps)]


def batch_digest(micro: list[tuple[Inputs, torch.Tensor]]) -> str:
    """sha256 of one update's micro-batches as read from the source (host tensors, before any device copy)."""
    named = {}
    for i, (x, y) in enumerate(micro):
        named.update({f"{i}/{name}": t for name, t in task.tensors_of(x).items()})
        named[f"{i}/targets"] = y
    return checkpoint.tensors_digest(named)


def _check_batch(step: int, digest: str, expected: str) -> None:
    """A trial's batch against the one the reference read at the same step (its ``batch_sha256``)."""
    if expected and digest != expected:
        raise UserError(
            f"training step {step + 1}: the batch read differs from the reference's (sha256 {digest[:12]}… vs "
            f"{expected[:12]}…): training items changed since freeze read them, or the Dataset or task.data is not "
            f"deterministic (make __getitem__ a function of its index, seeding any augmentation from it); then "
            f"`dvc repro --force`"
        )


SWAP_EVERY = 64
"""``neighbours_swapped`` trades one sample per this many of an update (at least one): the share of the default example's
update of 64 samples, whose one swapped sample moves FP32 about as much as a reduced precision does. One sample whatever
the batch would shrink the replicate's noise as 1/batch while AMP's own gap stays: at 16,384 samples an update the
replicate's mean loss gap fell to 2.2e-5 nats, under a healthy bfloat16 run's 1.5e-4, and the noise floor rolled it back."""


def neighbours_swapped(order: list[list[torch.Tensor]], offset: int = 0) -> list[list[torch.Tensor]]:
    """Another data order, the smallest that moves training: in each pair of consecutive updates, their first samples
    trade places, one per ``SWAP_EVERY`` of the smaller update (at least one), through its micro-batches in order (same
    samples, same counts, same batch sizes). ``offset`` 1 trades the next as many samples instead (the second ones at
    the default size): another draw of the same size of change, neither the reference's order nor offset 0's.

    Why this is the FP32 noise replicate: a training run is judged against how much a harmless change moves
    FP32 itself. A one-ulp change of the weights moves the loss by ~1e-7 (rounding stays rounding over a
    short run), far below what any real change does, so it cannot serve as a gate; another data-order seed
    changes every batch and moves it ~20x more than AMP does on the default example. One swapped sample in 64 per
    pair of updates moves it by as much as a reduced precision does (measured: docs/acceptance.md "Training")."""
    out = [[b.clone() for b in step] for step in order]
    for s in range(0, len(out) - 1, 2):
        a, b = ([(m, i) for m, t in enumerate(out[u]) for i in range(t.numel())] for u in (s, s + 1))
        size = min(len(a), len(b))
        k = -(-size // SWAP_EVERY)
        start = offset * k if (offset + 1) * k <= size else 0  # an update too small for the offset: the first samples
        for (ma, ia), (mb, ib) in zip(a[start : start + k], b[start : start + k]):
            first = out[s][ma][ia].clone()
            out[s][ma][ia], out[s + 1][mb][ib] = out[s + 1][mb][ib], first
    return out


def trial_order(n: int, cfg: ReferenceConfig, seed: int, policy: Policy) -> list[list[torch.Tensor]]:
    """The micro-batch indices a run under ``policy`` reads: the reference's (``update_batches``), or for
    ``data_order: swapped`` (FP32's A/A) the reference's with another block of samples of each pair of updates traded
    (``neighbours_swapped`` at offset ``cfg.replicates``): a fresh draw beside the noise replicates', which trade the
    blocks before it."""
    order = update_batches(n, cfg, seed)
    return neighbours_swapped(order, offset=cfg.replicates) if policy.data_order == "swapped" else order


def _expected(expect_batches: list[str], order: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> list[str]:
    """The reference's batch hashes for the steps whose indices are the reference's; "" (unchecked) for the others.

    Why unchecked: the reference never read a swapped update's batch, so it holds no hash of it, and reading it
    again here would only repeat this run's read. Their samples are the reference's, traded between neighbours; every
    step the swap left alone (an odd last update) is still checked."""
    same = [len(o) == len(r) and all(torch.equal(a, b) for a, b in zip(o, r)) for o, r in zip(order, reference)]
    return [h if i < len(same) and same[i] else "" for i, h in enumerate(expect_batches)]


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
    distributed.current().agree_found_inf(scaler, optimizer)  # FSDP2: each rank looked at its shard only
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor (the norm over every rank's shard)
        grad_norm = grad_norm.full_tensor()
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


@dataclass(frozen=True)
class TrainResult:
    records: list[StepRecord]
    real_updates: int
    state: checkpoint.Checkpoint
    final_scale: float
    """The GradScaler's scale after the last update; 1.0 when no scaler ran (FP32, bfloat16)."""


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
    source: TrainSource,
    cases_x: Inputs,
    cfg: ReferenceConfig,
    task_cfg: TaskConfig,
    policy: Policy,
    device: torch.device,
    seed: int,
    resume: checkpoint.Checkpoint | None = None,
    save_resume: Callable[[checkpoint.Checkpoint], None] | None = None,
    label: str = "trial",
    sink: Callable[[str, Iterator[dict[str, torch.Tensor]]], None] | None = None,
    expect_batches: list[str] | None = None,
    origin: checkpoint.Checkpoint | None = None,
) -> TrialResult:
    """A trial, the one definition trial@DTYPE and the diagnosis's re-runs share.

    Inference with the trained reference weights in the frozen train/eval mode; then training from the
    reference's initial state. ``make_initial`` restores that state (weights and RNG) and is called
    only after the inference, so that nothing the inference draws moves the RNG the training starts from.
    With ``sink``, outputs are streamed chunk by chunk to ``sink("outputs" | "trained_outputs", chunks)``
    instead of being held in memory; inference only (``cfg.train_steps`` 0), ``sink("trained_outputs", None)``: the
    same outputs again (the model trained for no step is the one inferred). ``origin``: the optimizer, scheduler and
    GradScaler state training starts from (the reference's ``init``: a user's checkpoint's, ``reference.checkpoint``),
    where it holds them.
    """

    def outputs(name: str, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        ran = precision.param_cast(model, policy)  # FSDP2's mixed precision: its parameters' dtype, in one process
        if sink is None:
            out = infer(ran, cases_x, policy, device, cfg.eval_mode)
        else:
            out = sink(name, infer_chunks(ran, cases_x, policy, device, cfg.eval_mode))
        if distributed.current().sharded:  # back to the host: the GPU holds the shards alone while the next run trains
            model.cpu()
        return out

    first = outputs("outputs", trained)
    model = make_initial()
    result = train(model, source, cfg, task_cfg, policy, device, seed, resume=resume, save_resume=save_resume, label=label,
                   expect_batches=expect_batches, origin=origin)
    if not cfg.train_steps:  # inference only: the model trained for no step is the one just inferred
        if sink is not None:
            sink("trained_outputs", None)  # the same outputs, not inferred twice
        return TrialResult(first, result, first, None)
    trained_outputs = outputs("trained_outputs", model)
    aligned = aligned_fp32(make_initial, source, cfg, task_cfg, device, seed, result.records, label, origin)
    return TrialResult(first, result, trained_outputs, aligned)


def aligned_fp32(make_initial: Callable[[], torch.nn.Module], source: TrainSource, cfg: ReferenceConfig, task_cfg: TaskConfig,
                 device: torch.device, seed: int, records: list[StepRecord], label: str,
                 origin: checkpoint.Checkpoint | None = None) -> list[StepRecord] | None:
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
    return train(make_initial(), source, cfg, task_cfg, Policy(), device, seed, label=f"{label} FP32 aligned on skips",
                 skip_steps=skips, origin=origin).records


def train(
    model: torch.nn.Module,
    source: TrainSource,
    cfg: ReferenceConfig,
    task_cfg: TaskConfig,
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
    on_step: Callable[[int], None] | None = None,
    origin: checkpoint.Checkpoint | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``cfg.train_steps`` optimizer updates under ``policy``, on ``source``
    with the task's loss. The caller has already put the model in its initial state (weights and RNG).
    With ``resume``, the loop continues from a saved state and ends exactly as if it had never stopped.

    Under torchrun with N > 1 ranks (``pipeline.distributed``), each rank trains on its slice of every
    micro-batch through DistributedDataParallel, records the loss averaged over the ranks, and only rank 0
    saves resume states. Under FSDP2 (``distributed.strategy: fsdp``) a sharded copy of ``model`` trains, and its
    gathered state is loaded into ``model`` at the end (on rank 0, which alone uses it).

    ``skip_steps``: steps whose update is not applied, as a GradScaler skip (the FP32 run aligned on a trial).
    ``batches``: another order of the micro-batch indices than the policy's (``trial_order``; the FP32 noise replicate).
    ``stop``: end after this many steps of the SAME run (the diagnosis replay): schedules keep their span.
    ``expect_batches``: the reference's per-step ``batch_sha256``; a step that reads other bytes stops the run
    with one line (checked on rank 0, whose shard the reference recorded).
    ``on_step``: called with the number of steps done after each step, once its resume state is saved: the
    tests' fault injection (a kill there must resume to the same bytes).
    ``origin``: the optimizer, scheduler and GradScaler state a run that does not resume starts from (a user's checkpoint's:
    ``checkpoint.start``), where it holds them; the model's weights are the caller's.
    """
    end = cfg.train_steps if stop is None else min(stop, cfg.train_steps)
    precision.strict_fp32()
    world = distributed.current()
    # Under FSDP2 a sharded copy trains on the device (``sharded_copy`` puts the whole model on the host, 4 bytes a
    # parameter off each GPU), and rank 0 loads the trained weights into it at the end.
    (model if world.sharded else model.to(device)).train()
    loss_fn = make_loss(task_cfg)
    if world.sharded and (policy.compiled or policy.float8 != "off"):
        raise UserError(f"{label}: distributed.strategy fsdp runs eager models without float8 here (compile "
                        f"{policy.compile}, float8 {policy.float8}); use strategy: ddp for this variant's policy")
    trainee = world.sharded_copy(model, device, precision.fsdp_mixed_precision(policy))  # the model, or FSDP2's shards
    optimizer = make_optimizer(trainee, cfg)
    load = world.load_full_state(trainee, optimizer) if world.sharded else None  # resume states into the shards
    scaler = precision.make_scaler(policy, device)
    order = batches if batches is not None else trial_order(len(source), cfg, seed, policy)
    if expect_batches is not None and batches is None and policy.data_order != "reference":
        expect_batches = _expected(expect_batches, order, update_batches(len(source), cfg, seed))
    records: list[StepRecord] = []
    real_updates = 0
    start = 0
    if resume is not None and not resume.info.step < cfg.train_steps:  # states are saved before the last step only
        print(f"warning: {label}: the resume state is at step {resume.info.step} of a {cfg.train_steps}-step run "
              f"(edited?); restarts from step 0", file=sys.stderr)
        resume = None
    if resume is not None and _stale(resume, source, order, world, label, device):
        resume = None
    if resume is None and origin is not None:  # before the schedule is built on it: its lr, initial_lr are the saved ones
        checkpoint.continue_optimizer(origin, optimizer, cfg.optimizer, load)
    scheduler = make_scheduler(optimizer, cfg)
    if resume is None and origin is not None:
        checkpoint.continue_schedule(origin, scaler, scheduler)
    if resume is not None:
        checkpoint.restore(resume, trainee, optimizer, scaler, scheduler, load=load)
        saved = resume.info  # ``ResumeFile.load`` checked its counters
        records = [StepRecord.from_dict(r) for r in saved.records]
        real_updates, start = saved.real_updates, saved.step
    params = [p for p in trainee.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    resumable = save_resume is not None  # under FSDP2 every rank gathers each resume state; rank 0 alone saves it
    if not world.writes:
        save_resume = None
    progress = Progress(label, end, start)
    runnable = transforms.apply(trainee, policy, device).model  # float8 layers in place, the compiled wrapper; else model
    with precision.fp32_regions(trainee, policy, device):
        net = runnable if world.sharded else world.wrap(runnable, device)  # the model itself in one process
        for step in range(start, end):
            micro = _read_update(source, order[step], world, step)
            digest = batch_digest(micro)
            if expect_batches is not None and world.rank == 0 and step < len(expect_batches):
                _check_batch(step, digest, expect_batches[step])
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
            if resumable and (save_resume is not None or world.sharded) and every and (step + 1) % every == 0 and step + 1 < end:
                saved = _snapshot(trainee, optimizer, scaler, scheduler, records, real_updates, step + 1, policy, world)
                if save_resume is not None:
                    save_resume(saved)
            if on_step is not None:
                on_step(step + 1)
    state = _snapshot(trainee, optimizer, scaler, scheduler, records, real_updates, end, policy, world)
    if world.sharded and world.writes:  # the caller's model: the trained weights, whole (rank 0 alone infers)
        model.load_state_dict(state.model_state(), strict=True)
    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    return TrainResult(records=records, real_updates=real_updates, state=state, final_scale=final_scale)


def _stale(resume: checkpoint.Checkpoint, source: TrainSource, order: list[list[torch.Tensor]], world: distributed.World,
           label: str, device: torch.device) -> bool:
    """Whether a resume state was trained on other data than the source gives now: every update it recorded is read
    again (data only, no compute) and its ``batch_sha256`` compared, so that a training item edited after a kill, read
    before it and maybe never after, cannot leave a reference trained half on each version (a result no uninterrupted
    run gives). Such a state is ignored with one line and training restarts from step 0: the same bytes as a clean
    run on today's data. Rank 0 reads (its shard is what the records hold); every rank follows its answer."""
    records = [StepRecord.from_dict(r) for r in resume.info.records]
    differ = None
    if world.rank == 0:
        differ = next((i for i, r in enumerate(records[: resume.info.step])
                       if r.batch_sha256 and batch_digest(_read_update(source, order[i], world, i)) != r.batch_sha256), None)
    if float(world.mean(torch.tensor(0.0 if differ is None else 1.0, device=device))) == 0.0:  # NCCL reduces on the GPU
        return False
    if world.writes:
        print(f"warning: {label}: the batch of step {differ + 1} reads other bytes than the resume state recorded: training "
              f"items changed since it was saved (or the Dataset is not deterministic: make __getitem__ a function of its "
              f"index); the state is ignored, training restarts from step 0", file=sys.stderr, flush=True)
    return True


def _read_update(
    source: TrainSource, micro_idx: list[torch.Tensor], world: distributed.World, step: int
) -> list[tuple[Inputs, torch.Tensor]]:
    """This rank's share of one update's micro-batches, as read from the source (host tensors)."""
    micro = []
    for idx in micro_idx:
        try:
            micro.append(source.batch(world.shard(idx)))
        except UserError as exc:  # a bad item of a Dataset: say which training step met it
            raise UserError(f"training step {step + 1}: {exc}") from None
    return micro


def _snapshot(model, optimizer, scaler, scheduler, records, real_updates, step, policy,
              world: distributed.World = distributed.World()) -> checkpoint.Checkpoint:
    return checkpoint.capture(
        model,
        optimizer,
        scaler,
        scheduler,
        step=step,
        real_updates=real_updates,
        records=[r.as_dict() for r in records],
        policy=policy.as_dict(),
        states=world.full_state(model, optimizer) if world.sharded else None,
    )


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
        now = time.monotonic()
        if self.enabled and (now - self.last >= 0.5 or done == self.total):
            self.last = now
            end = "\n" if done == self.total else ""
            # \x1b[K clears the rest of the line: a shorter line ("ETA 9s" after "ETA 10s") leaves no residue.
            print(f"\r{self.line(done, loss, scale, skipped, now)}\x1b[K", end=end, file=sys.stderr, flush=True)
        if done == self.total:  # the training's time, on stdout (never a DVC output): scripts/timings.py reads it
            print(f"{self.label}: {done - self.start} steps in {now - self.t0:.2f} s", flush=True)


def replicate_key(run_key: str, index: int = 0) -> str:
    """The noise replicate's run key: another run than the reference whose ``run_key`` it repeats on another data
    order, so that neither resumes the other's state (a replicate state taken for the reference's trained it on the
    swapped order)."""
    return hashlib.sha256(f"{run_key}/replicate{index or ''}".encode()).hexdigest()


@dataclass
class Replicate:
    """One of freeze's FP32 noise replicates: its updates, and the weights it trained to (whose quality on the fixed set
    is FP32's own spread after training: ``model`` rebuilds it, one replicate's model in memory at a time). Its optimizer
    state is not kept: K replicates hold K copies of the weights, not of AdamW's moments too."""

    records: list[StepRecord]
    weights: dict[str, torch.Tensor]

    def model(self, params: Params) -> torch.nn.Module:
        """The model this replicate trained (built as the reference is, its trained weights loaded; RNG untouched)."""
        model = task.build_model(params.task, params.seed)
        model.load_state_dict(self.weights, strict=True)
        return model


def noise_replicates(params: Params, init: checkpoint.Checkpoint, source: TrainSource, device: torch.device,
                     run_key: str) -> list[Replicate]:
    """freeze's ``reference.replicates`` FP32 noise replicates: each from the reference's start (weights and RNG,
    ``init``) on another data order (``neighbours_swapped`` at offset k for the k-th: each its own draw). Resumable as
    the reference is, each under its own key. None for an inference-only reference (``train_steps`` 0): nothing trains."""
    out = []
    for k in range(params.reference.replicates if params.reference.train_steps else 0):
        model = task.build_model(params.task, params.seed)
        checkpoint.restore(init, model)
        order = neighbours_swapped(update_batches(len(source), params.reference, params.seed), offset=k)
        name = "replicate.safetensors" if k == 0 else f"replicate-{k}.safetensors"
        resume = checkpoint.ResumeFile(paths.RESUME / name, distributed.current().key(replicate_key(run_key, k)), device)
        result = train(
            model, source, params.reference, params.task, Policy(), device, params.seed, resume=resume.load(),
            save_resume=resume.save, label=f"freeze FP32 replicate {k + 1}/{params.reference.replicates}", batches=order,
            origin=init,
        )
        if distributed.current().writes:
            resume.clear()
        out.append(Replicate(result.records, result.state.model_state()))
        del model
    return out
