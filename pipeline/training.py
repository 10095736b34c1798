"""The training loop shared by the FP32 reference and every AMP trial, and inference on the fixed set.

One loop, so that the reference and the trial differ only by their precision policy: same initial
state, same batches in the same order, same optimizer. The step follows the AMP recipe: scaler created
once; zero_grad(set_to_none=True); autocast around forward and loss only; backward after the context
closes; unscale_ once, before clipping; scaler.step; scaler.update. A step whose update the scaler
skipped does not count as a real update, and the learning-rate schedule follows real updates only.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pipeline import checkpoint, precision
from pipeline.config import ReferenceConfig
from pipeline.precision import Policy
from pipeline.task import named_outputs, primary


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    scale: float
    skipped: bool
    real_updates: int
    lr: float


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Indices of each step's batch: epochs of seeded permutations, independent of the global RNG."""
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


def loss_function(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind == "cross_entropy":
        return lambda out, y: torch.nn.functional.cross_entropy(out, y.long())
    return lambda out, y: torch.nn.functional.mse_loss(out.reshape(y.shape[0], -1), y.reshape(y.shape[0], -1).to(out.dtype))


def make_optimizer(model: torch.nn.Module, cfg: ReferenceConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: ReferenceConfig):
    if cfg.lr_schedule.kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.lr_schedule.every, gamma=cfg.lr_schedule.gamma)
    return None


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
    outputs: dict[str, torch.Tensor]
    """The trained reference's outputs on the fixed set, under the policy."""
    training: TrainResult
    """The training repeated from the reference's initial state, under the policy."""
    trained_outputs: dict[str, torch.Tensor]
    """Outputs on the fixed set of the model trained under the policy."""


def run_trial(
    trained: torch.nn.Module,
    make_initial: Callable[[], torch.nn.Module],
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    cases_x: torch.Tensor,
    cfg: ReferenceConfig,
    loss_kind: str,
    policy: Policy,
    device: torch.device,
    seed: int,
    resume: checkpoint.Checkpoint | None = None,
    save_resume: Callable[[checkpoint.Checkpoint], None] | None = None,
    label: str = "trial",
) -> TrialResult:
    """A trial, the one definition trial@DTYPE and the diagnosis's re-runs share.

    Inference with the trained reference weights in the frozen train/eval mode; then training from the
    reference's initial state. ``make_initial`` restores that state (weights and RNG) and is called
    only after the inference, so that nothing the inference draws moves the RNG the training starts from.
    """
    outputs = infer(trained, cases_x, policy, device, cfg.eval_mode)
    model = make_initial()
    result = train(model, train_x, train_y, cfg, loss_kind, policy, device, seed, resume=resume, save_resume=save_resume, label=label)
    return TrialResult(outputs, result, infer(model, cases_x, policy, device, cfg.eval_mode))


def train(
    model: torch.nn.Module,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    cfg: ReferenceConfig,
    loss_kind: str,
    policy: Policy,
    device: torch.device,
    seed: int,
    resume: checkpoint.Checkpoint | None = None,
    save_resume: Callable[[checkpoint.Checkpoint], None] | None = None,
    label: str = "train",
) -> TrainResult:
    """Train ``model`` in place for ``cfg.train_steps`` steps under ``policy``.

    The caller has already put the model in its initial state (weights and RNG). With ``resume``, the
    loop continues from a saved state and ends exactly as if it had never stopped.
    """
    precision.strict_fp32()
    model.to(device).train()
    loss_fn = loss_function(loss_kind)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    scaler = precision.make_scaler(policy, device)
    order = batch_order(train_x.shape[0], cfg.batch_size, cfg.train_steps, seed)
    records: list[StepRecord] = []
    real_updates = 0
    start = 0
    if resume is not None:
        checkpoint.restore(resume, model, optimizer, scaler, scheduler)
        records = [StepRecord(**r) for r in resume.meta["records"]]
        real_updates = resume.meta["real_updates"]
        start = resume.meta["step"]
    params = [p for p in model.parameters() if p.requires_grad]
    kill_after = int(os.environ.get("PIPELINE_KILL_AFTER_STEP", "0"))
    progress = Progress(label, cfg.train_steps, start)
    with precision.fp32_regions(model, policy, device):
        for step in range(start, cfg.train_steps):
            idx = order[step]
            x, y = train_x[idx].to(device), train_y[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast(policy, device):
                loss = loss_fn(primary(named_outputs(model(x))), y)
            scale = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.is_enabled() and scaler.get_scale() < scale
            if not skipped:
                real_updates += 1
                if scheduler is not None:
                    scheduler.step()
            records.append(
                StepRecord(
                    step=step,
                    loss=float(loss.item()),
                    grad_norm=float(grad_norm.item()),
                    scale=float(scale),
                    skipped=bool(skipped),
                    real_updates=real_updates,
                    lr=float(optimizer.param_groups[0]["lr"]),
                )
            )
            progress.tick(step + 1, records[-1].loss)
            every = cfg.checkpoint_every
            if save_resume is not None and every and (step + 1) % every == 0 and step + 1 < cfg.train_steps:
                save_resume(_snapshot(model, optimizer, scaler, scheduler, records, real_updates, step + 1, policy))
            if kill_after == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection for the kill-and-resume tests
    state = _snapshot(model, optimizer, scaler, scheduler, records, real_updates, cfg.train_steps, policy)
    return TrainResult(records=records, real_updates=real_updates, state=state)


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


@torch.no_grad()
def infer(
    model: torch.nn.Module,
    x: torch.Tensor,
    policy: Policy,
    device: torch.device,
    eval_mode: bool,
    batch_size: int = 256,
) -> dict[str, torch.Tensor]:
    """Outputs of ``model`` on ``x`` under ``policy``, as float32 CPU tensors (exact for fp16/bf16 values)."""
    precision.strict_fp32()
    model.to(device)
    model.train(not eval_mode)
    chunks: dict[str, list[torch.Tensor]] = {}
    with precision.fp32_regions(model, policy, device):
        for start in range(0, x.shape[0], batch_size):
            with precision.autocast(policy, device):
                out = named_outputs(model(x[start : start + batch_size].to(device)))
            for name, value in out.items():
                chunks.setdefault(name, []).append(value.detach().float().cpu())
    return {name: torch.cat(parts) for name, parts in chunks.items()}


class Progress:
    """Per-step lines with rate and ETA on a terminal; silent when output is not a terminal."""

    def __init__(self, label: str, total: int, start: int = 0) -> None:
        self.label, self.total, self.start = label, total, start
        self.t0 = time.monotonic()
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def tick(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.5 and done < self.total:
            return
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        end = "\n" if done == self.total else ""
        # \x1b[K clears the rest of the line: a shorter line ("ETA 9s" after "ETA 10s") leaves no residue.
        print(f"\r{self.label}: step {done}/{self.total} loss {loss:.4f} {rate:.1f} step/s ETA {eta:.0f}s\x1b[K", end=end, file=sys.stderr, flush=True)
