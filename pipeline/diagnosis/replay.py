"""Replaying a trial's failing cases exactly, under its policy and under FP32, and re-running the trial.

A ``Context`` holds what every replay needs, loaded once and checked against the manifests: the frozen
reference, the training data, the device and the diagnose budget's counters (``work``). A ``Case`` is one
replayable pass (model state, inputs, RNG state, loss scale), so that every policy sees the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from pipeline import checkpoint, devices, recipe, task, training, transforms

from pipeline import rule

from pipeline.artifacts import reference_tensors
from pipeline.artifacts.audit import Audit
from pipeline.artifacts.comparison import Stats
from pipeline.artifacts.diagnosis import LocatedCase, Rerun, Trace, Work
from pipeline.artifacts.steps import Steps

from pipeline.compare import streams
from pipeline.artifacts import trial_tensors
from pipeline.config import Params
from pipeline.diagnosis import audit
from pipeline.diagnosis.trace import finite, trace
from pipeline.diagnosis.triage import first_nonfinite_step
from pipeline.config import Policy

FP32 = Policy()


@dataclass
class Run:
    """One trial's results: the original (from its files) or a re-run under another policy."""

    policy: Policy
    outputs: streams.Source
    """Its outputs on the fixed set: the trial's file (read a slice of rows at a time), or a re-run's tensors."""
    steps: Steps
    stats: Stats
    decision: rule.RuleResult

    @property
    def accepted(self) -> bool:
        return self.decision.accepted

    @property
    def has_nonfinite(self) -> bool:
        return first_nonfinite_step(self.steps) is not None or any(g.nonfinite_trial_only for g in self.stats.values.values())

    def summary(self) -> Rerun:
        return Rerun(tuple(self.policy.fp32_modules), self.decision.decision, tuple(self.decision.reasons))


@dataclass
class Context:
    params: Params
    variant: str
    device: torch.device
    ref: reference_tensors.Reference
    train: task.TrainSource
    work: Work = field(default_factory=Work)
    """What the diagnosis has cost so far (``spend`` adds to it)."""
    audits: dict[Policy, Audit] = field(default_factory=dict)
    """``engaged``'s, once per policy."""

    def model(self, state: str) -> torch.nn.Module:
        """The task's model in the reference's ``trained`` state (weights only) or ``init`` state (weights and RNG)."""
        model = task.build_model(self.params.task, self.params.seed)
        if state == "init":
            checkpoint.restore(self.ref.checkpoint("init"), model)
        else:
            checkpoint.restore(self.ref.checkpoint(), model, rng=False)
        return model.to(self.device)

    def loss(self) -> recipe.Loss:
        return recipe.make_loss(self.params.task)

    def first_batch_of_update(self, step: int) -> tuple[task.Inputs, torch.Tensor]:
        """The first micro-batch of optimizer update ``step``, in the fixed order reference and trials share."""
        idx = training.update_batches(len(self.train), self.params.reference, self.params.seed)[step][0]
        return self.train.batch(idx)

    def spend(self, replayed_steps: int = 0, traced_passes: int = 0, trial_reruns: int = 0) -> None:
        self.work = self.work.plus(replayed_steps, traced_passes, trial_reruns)

    @property
    def budget_left(self) -> bool:
        return self.work.trial_reruns < self.params.diagnose.search_budget


@dataclass
class Case:
    """A replayable case: model state, inputs, RNG state and loss scale, frozen so every policy sees the same."""

    label: str
    model: torch.nn.Module
    x: task.Inputs
    y: torch.Tensor | None
    loss_fn: object
    scale: float
    rng: dict[str, torch.Tensor]
    ids: list[str] = field(default_factory=list)
    step: int | None = None
    replay_matches_trial: bool | None = None

    def trace(self, ctx: Context, policy: Policy, scale: float | None = None) -> Trace:
        checkpoint.set_rng_state(self.rng)
        ctx.spend(traced_passes=1)
        return trace(self.model, self.x, self.y, self.loss_fn, policy, ctx.device, self.scale if scale is None else scale)


@dataclass
class Located:
    """A failing case traced under the run's policy, under FP32, and (for a gradient failure at a loss
    scale above 1) without scaling, which separates a scale that overflowed from a real overflow."""

    case: Case
    amp: Trace
    fp32: Trace
    unscaled: Trace | None = None

    @property
    def autocast_problem(self) -> bool:
        return not finite(self.amp) and not (self.unscaled is not None and finite(self.unscaled))

    def record(self) -> LocatedCase:
        c = self.case
        return LocatedCase(c.label, tuple(c.ids), c.step, c.scale, c.replay_matches_trial, self.amp, self.fp32, self.unscaled)


def load(params: Params, variant: str, stats: Stats, decision: rule.RuleResult) -> tuple[Context, Run, trial_tensors.Trial]:
    """The reference, the training data and the trial's own results, each checked against its manifest.
    ``decision`` is the rule's verdict on the trial, computed once by the stage."""
    ref = reference_tensors.load(params)
    ctx = Context(params, variant, devices.resolve(params.device), ref, ref.train_data(params))
    trial = trial_tensors.load(variant, ref.manifest)
    policy = Policy.from_dict(trial.manifest.policy)  # what ran, not what params say now
    return ctx, Run(policy, trial.reader("outputs"), trial.trajectory.steps, stats, decision), trial


def inference_case(ctx: Context, run: Run) -> Case | None:
    """The fixed-set cases where compare found the run's outputs non-finite (``stats.nonfinite.trial``: where it judges
    them; a masked class's -inf is no fault), the first ``diagnose.max_cases`` of them."""
    listed = set(run.stats.nonfinite.trial.ids)
    if not listed:
        return None
    idx = torch.tensor([i for i, case in enumerate(ctx.ref.cases.ids) if case in listed][: ctx.params.diagnose.max_cases],
                       dtype=torch.long)
    model = ctx.model("trained")
    model.train(not ctx.params.reference.eval_mode)
    ids = [ctx.ref.cases.ids[i] for i in idx.tolist()]
    x = task.take(ctx.ref.cases.x, idx)
    return Case(f"inference on {len(ids)} failing case(s)", model, x, None, None, 1.0, checkpoint.rng_state(), ids=ids)


def training_case(ctx: Context, run: Run, step: int) -> Case:
    """Training step ``step`` exactly as the run met it: the steps before it are replayed from the
    reference's initial state (weights and RNG) under the run's policy, in the fixed batch order. With
    gradient accumulation the traced pass is the update's first micro-batch."""
    model = ctx.model("init")
    cfg = replace(ctx.params.reference, checkpoint_every=0)  # the run's own schedule (its span is train_steps), stopped at step
    result = training.train(
        model,
        ctx.train,
        cfg,
        ctx.params.task,
        run.policy,
        ctx.device,
        ctx.params.seed,
        label=f"diagnose replay {ctx.variant}",
        stop=step,
        origin=ctx.ref.checkpoint("init"),  # reference.checkpoint's optimizer and GradScaler state, as the trial began
    )
    ctx.spend(replayed_steps=step)
    replayed = [r.loss for r in result.records]
    recorded = [s.loss for s in run.steps[:step]]
    matches = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(replayed, recorded))
    scale = float(result.final_scale) if run.policy.uses_scaler else 1.0
    x, y = ctx.first_batch_of_update(step)
    rng = checkpoint.rng_state()
    return Case(f"training step {step}", model, x, y, ctx.loss(), scale, rng, step=step, replay_matches_trial=matches)


def locate(ctx: Context, run: Run) -> list[Located]:
    """Each failing case of ``run``, traced under its policy and under FP32."""
    cases = []
    inference = inference_case(ctx, run)
    if inference is not None:
        cases.append(inference)
    step = first_nonfinite_step(run.steps)
    if step is not None:
        cases.append(training_case(ctx, run, step))
    located = []
    for c in cases:
        amp = c.trace(ctx, run.policy)
        gradient = amp.first is not None and amp.first.where == "gradient"
        unscaled = c.trace(ctx, run.policy, scale=1.0) if gradient and c.scale != 1.0 else None
        located.append(Located(c, amp, c.trace(ctx, FP32, scale=1.0), unscaled))
    return located


def rerun(ctx: Context, policy: Policy) -> Run:
    """The trial again under ``policy``, as trial@DTYPE runs it, then compare and the rule."""
    params, ref = ctx.params, ctx.ref
    run = training.run_trial(
        ctx.model("trained"),
        lambda: ctx.model("init"),
        ctx.train,
        ref.cases.x,
        params.reference,
        params.task,
        policy,
        ctx.device,
        params.seed,
        label=f"diagnose re-run {ctx.variant}",
        origin=ref.checkpoint("init"),
    )
    steps = tuple(run.training.records)
    aligned = tuple(run.aligned) if run.aligned is not None else None
    outputs = streams.InMemory(run.outputs)
    stats = _compare(ctx, outputs, streams.InMemory(run.trained_outputs), steps, run.training.final_scale,
                     policy.uses_scaler, ref.fp64_reader(), aligned)
    ctx.spend(trial_reruns=1)
    return Run(policy, outputs, steps, stats, rule.decide(stats, params.acceptance, engaged(ctx, policy)))


def engaged(ctx: Context, policy: Policy) -> Audit:
    """The audit trial@NAME would write under ``policy`` (``audit.of_trial``: the trained reference, its float8 layers
    converted, one training pass on the first micro-batch, and the FP32 pass beside it), computed once per policy: what
    decide holds a variant's AMP share to, at the cost of two traced passes instead of a re-run."""
    if policy not in ctx.audits:
        applied = transforms.apply(ctx.model("trained"), policy.eager, ctx.device)
        ctx.audits[policy] = audit.of_trial(applied.module, ctx.train, ctx.params, policy, ctx.device)
        ctx.spend(traced_passes=2 if policy.float8 == "off" else 1)
    return ctx.audits[policy]


def reference_fails_itself(ctx: Context) -> list[str]:
    """Reasons the rule rejects the FP32 reference compared with itself: no precision policy can fix those. Its
    outputs are read from their file a chunk at a time, as compare reads them (an LM's are never whole here)."""
    ref = ctx.ref
    stats = _compare(ctx, ref.outputs_reader(), ref.outputs_reader(), ref.trajectory, math.inf, True, None)
    return list(rule.decide(stats, ctx.params.acceptance).reasons)


def _compare(ctx: Context, outputs: streams.Source, trained: streams.Source, steps: Steps, final_scale: float, scaler: bool,
             fp64, aligned: Steps | None = None) -> Stats:
    """Statistics as the compare stage computes them (the reference's outputs read from their file, metric,
    chunking, token mask, FP64 arbiter, noise replicate), so that a re-run's verdict is the stage's rule."""
    params, ref = ctx.params, ctx.ref
    sources = streams.Sources(ref.cases.ids, ref.cases.y, ref.cases.has_target, ref.outputs_reader(), outputs, trained,
                              fp64, task.token_mask_of(ref.cases.x))
    runs = streams.Trajectories(ref.trajectory, steps, final_scale, scaler, ref.replicate, aligned, ref.spread,
                                ref.replicates[1:])
    stats, _ = streams.compare_streams(params.task.kind, params.acceptance, sources, runs,
                                       metric=streams.Metric.for_task(params.task), cfg=params.compare,
                                       roles=ref.manifest.output_roles())
    return stats
