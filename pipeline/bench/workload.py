"""What every variant trains: the reference's initial model and the trial's first update, stepped by the
trial's own update function with nothing read back to the host."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline import checkpoint, distributed, paths, precision, recipe, task, training, transforms
from pipeline.config import Params
from pipeline.config import Policy


@dataclass
class Workload:
    """A model in its initial state and the trial's first update, on the device (mutable: the model trains)."""

    model: torch.nn.Module
    micro_batches: list[tuple[task.Inputs, torch.Tensor]]
    params: Params
    device: torch.device
    scaler_state: dict
    """The trial's final GradScaler ``state_dict`` (empty for bfloat16 or without a trial)."""

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_workload(params: Params, device: torch.device, variant: str | None = None) -> Workload:
    """The reference's initial model, the trial's first update's micro-batches and (with ``variant``) the scaler
    state the trial of ``variant`` ended with (read from the stages' outputs).

    Raises:
        UserError: prepare, freeze or trial@NAME has not run.
    """
    from pipeline.artifacts import trial_tensors

    source = task.load_train(params.task, paths.PREPARED_TRAIN)
    first_update = training.update_batches(len(source), params.reference, params.seed)[0]
    micro = []
    for idx in first_update:
        x, y = source.batch(distributed.current().shard(idx))  # under torchrun: this rank's slice
        micro.append((task.to_device(x, device), y.to(device)))
    model = task.build_model(params.task, params.seed)
    checkpoint.restore(checkpoint.load(paths.REF_INIT), model, rng=False)
    scaler_state = {}
    if variant is not None and params.trial.policy(variant).uses_scaler:  # bfloat16 runs no scaler: nothing to read
        scaler_state = trial_tensors.load(variant).checkpoint().info.grad_scaler
    return Workload(model.to(device).train(), micro, params, device, scaler_state)


class TrainingStep:
    """One training update of the trial's, by ``training.amp_step`` with nothing read back to the host.

    ``updates`` counts the optimizer updates really made (a step post-hook: GradScaler calls
    ``optimizer.step`` only when the gradients are finite), so a caller can tell skipped steps apart
    without a sync of its own.
    """

    def __init__(self, work: Workload, policy: Policy) -> None:
        cfg = work.params.reference
        self.work, self.policy = work, policy
        self.loss_fn = recipe.make_loss(work.params.task)
        self.optimizer = recipe.make_optimizer(work.model, cfg)
        self.scaler = precision.make_scaler(policy, work.device)
        if self.scaler.is_enabled() and work.scaler_state:
            self.scaler.load_state_dict(work.scaler_state)
        self.trainable = [p for p in work.model.parameters() if p.requires_grad]
        self.max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        self.updates = 0
        self.optimizer.register_step_post_hook(self._count)
        self.applied = transforms.apply(work.model, policy, work.device)  # float8 layers, the compiled wrapper
        self.net = distributed.current().wrap(self.applied.model, work.device)  # DDP under torchrun: all-reduce is timed

    def _count(self, *_: object) -> None:
        self.updates += 1

    def __call__(self) -> None:
        w = self.work
        training.amp_step(
            self.net, w.micro_batches, self.loss_fn, self.optimizer, self.scaler, self.policy, w.device,
            self.max_norm, self.trainable, read_back=False,
        )


class InferenceStep:
    """One forward pass under the trial's policy of the first update's batches, without gradients, in the reference's
    train or eval mode: what an inference-only verdict (``reference.train_steps: 0``) judges, and so what it times.
    No optimizer, no scaler: no update to count (``timing.update_count`` reads None)."""

    def __init__(self, work: Workload, policy: Policy) -> None:
        self.work, self.policy = work, policy
        work.model.train(not work.params.reference.eval_mode)
        self.applied = transforms.apply(work.model, policy, work.device)  # float8 layers, the compiled wrapper

    def __call__(self) -> None:
        w = self.work
        with torch.no_grad(), precision.autocast(self.policy, w.device):
            for x, _ in w.micro_batches:
                task.call(self.applied.model, x)


def step_for(work: Workload, policy: Policy) -> TrainingStep | InferenceStep:
    """What the benchmark times of ``policy``: a training update, or, where nothing is trained (an inference-only
    verdict), a forward pass."""
    return InferenceStep(work, policy) if work.params.reference.train_steps == 0 else TrainingStep(work, policy)
