"""What every variant trains: the reference's initial model and the trial's first update, stepped by the
trial's own update function with nothing read back to the host. Under ``distributed.strategy: fsdp`` each step
trains a copy sharded by FSDP2, as the trials do (``training.train``), with FSDP2's mixed precision where the policy
asks for it."""

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

    ``model`` is the module trained: the workload's, or under FSDP2 its sharded copy (``World.sharded_copy``, with the
    policy's FSDP2 mixed precision), which then replaces the workload's (the trials keep the whole model beside the
    shards for rank 0's inference; a training step does not need it). The optimizer is built on its parameters, and
    ``amp_step`` agrees the GradScaler's skip over the ranks (``World.agree_found_inf``).

    ``updates`` counts the optimizer updates really made (a step post-hook: GradScaler calls
    ``optimizer.step`` only when the gradients are finite), so a caller can tell skipped steps apart
    without a sync of its own.
    """

    def __init__(self, work: Workload, policy: Policy) -> None:
        cfg = work.params.reference
        world = distributed.current()
        self.work, self.policy = work, policy
        self.model = work.model = world.sharded_copy(work.model, work.device, precision.fsdp_mixed_precision(policy))
        self.loss_fn = recipe.make_loss(work.params.task)
        self.optimizer = recipe.make_optimizer(self.model, cfg)
        self.scaler = precision.make_scaler(policy, work.device)
        if self.scaler.is_enabled() and work.scaler_state:
            self.scaler.load_state_dict(work.scaler_state)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        self.updates = 0
        self.optimizer.register_step_post_hook(self._count)
        self.applied = transforms.apply(self.model, policy, work.device)  # float8 layers, the compiled wrapper
        # DDP under torchrun (its all-reduce is timed); FSDP2's shards gather and reduce-scatter by themselves.
        self.net = self.applied.model if world.sharded else world.wrap(self.applied.model, work.device)

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
    No optimizer, no scaler: no update to count (``timing.update_count`` reads None). ``model``: the module run, as the
    trial infers (FSDP2's mixed precision as a cast copy, ``precision.param_cast``, which replaces the workload's)."""

    def __init__(self, work: Workload, policy: Policy) -> None:
        self.work, self.policy = work, policy
        work.model.train(not work.params.reference.eval_mode)
        self.model = work.model = precision.param_cast(work.model, policy)
        self.applied = transforms.apply(self.model, policy, work.device)  # float8 layers, the compiled wrapper

    def __call__(self) -> None:
        w = self.work
        with torch.no_grad(), precision.autocast(self.policy, w.device):
            for x, _ in w.micro_batches:
                task.call(self.applied.model, x)


def forward_param_dtypes(step: TrainingStep | InferenceStep) -> tuple[str, ...]:
    """The dtypes of the parameters as the forward reads them, seen over one more (untimed) call of ``step``: FSDP2's
    mixed precision casts them (``bfloat16``), autocast does not (``float32``: it casts op by op). Every rank must call
    it under FSDP2 (the step gathers)."""
    seen: set[str] = set()

    def look(module: torch.nn.Module, _args: object) -> None:  # after FSDP2's own pre-hook: the gathered parameters
        seen.update(str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False))

    handles = [m.register_forward_pre_hook(look) for m in step.model.modules() if next(m.parameters(False), None) is not None]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return tuple(sorted(seen))


def step_for(work: Workload, policy: Policy) -> TrainingStep | InferenceStep:
    """What the benchmark times of ``policy``: a training update, or, where nothing is trained (an inference-only
    verdict), a forward pass."""
    return InferenceStep(work, policy) if work.params.reference.train_steps == 0 else TrainingStep(work, policy)
