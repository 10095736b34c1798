"""The whole diagnosis of one failing (or probed) trial, in the order a reader needs it."""

from __future__ import annotations

import math
from dataclasses import replace

from pipeline import paths, precision
from pipeline.artifacts.comparison import Stats
from pipeline.artifacts.diagnosis import Diagnosis, PrecisionMap, Suggestion, Underflow
from pipeline.artifacts.trial import Trajectory
from pipeline.config import Params
from pipeline.rule import RuleResult
from pipeline.diagnosis import wording
from pipeline.diagnosis.precision_map import gradient_underflow, precision_map
from pipeline.diagnosis.replay import Context, Run, load, locate, reference_fails_itself, rerun
from pipeline.diagnosis.search import Outcome, reduced_modules, search, unflip
from pipeline.diagnosis.triage import triage
from pipeline.task import to_device


def run(params: Params, variant: str, stats: Stats, trajectory: Trajectory, decision: RuleResult) -> Diagnosis:
    """Triage, then probe, replays and search as ``params.diagnose`` allows. ``decision`` is the rule's
    verdict on the trial (computed once, by the stage). ``work`` counts what it cost, in units of the
    trial's own work (deterministic, unlike seconds).

    Findings come in the order a reader needs them: where the failure starts, what fixes it, the
    suggestion, then what the probe saw, then the recorded facts triage found.
    """
    precision.strict_fp32()  # first: the probe, the replays and the FP32 side of every comparison are exact FP32, never TF32
    triaged = triage(stats, trajectory.steps, decision.reasons)
    ctx, trial_run, trial = load(params, variant, stats, decision)
    dtype = trial_run.policy.dtype
    cfg = params.diagnose
    pmap = under = None
    probe_found: list[str] = []
    notes = list(triaged.notes)
    replayable = trial_run.policy.fsdp_param_dtype is None  # FSDP2's own casts run under its ranks, not in this process
    if replayable and (cfg.probe == "always" or (cfg.probe == "on_failure" and triaged.needed)):
        pmap, under = probe(ctx, trial_run, trial.trajectory.final_scale)
        probe_found, probe_notes = wording.probe_findings(pmap, under, trial_run.policy, ctx.device)
        notes += probe_notes
    findings: list[str] = []
    outcome = Outcome()  # nothing searched: no fix, no re-run, no suggestion
    own = located = unflipped = None
    eager_passes = False
    if triaged.needed and trial_run.policy.compiled and ctx.budget_left:  # compile or precision? the policy again, eager
        eager = rerun(ctx, trial_run.policy.eager)
        outcome.reruns.append(eager.summary())
        findings.append(wording.compile_line(trial_run, eager))
        eager_passes = eager.accepted
    if triaged.needed and not eager_passes:  # eager passes: no FP32 region fixes what the compiler changed
        own = reference_fails_itself(ctx)
        if own:
            findings.append(wording.reference_fails_line(own))
    if triaged.needed and not replayable:
        findings.append(wording.fsdp_mixed_line(trial_run.policy))
    elif triaged.needed and not eager_passes:
        located = locate(ctx, trial_run)
        findings += [wording.describe(loc, dtype) for loc in located]
        searched = search(ctx, trial_run, located, reference_fails=bool(own))
        searched.reruns[:0] = outcome.reruns  # the eager re-run first, then the search's
        outcome = searched
        findings += outcome.findings
        flips = stats.flips.flip_list
        if any(not f.boundary for f in flips):  # each flipped real case: which module's FP32 replay un-flips it
            order = [r.module for r in outcome.ranking] or reduced_modules(ctx, trial_run.policy)
            unflipped = unflip(ctx, trial_run, flips, order)
            findings += wording.unflip_lines(unflipped, ctx.params.diagnose.search_budget)
    file = str(paths.diagnose(variant) / "suggested_params.yaml")
    findings += wording.suggestion_lines(outcome, file, dtype)
    recorded = triaged.findings
    if located:  # the located cases say it better than the recorded counts
        notes, recorded = notes + recorded, []
    return replace(
        triaged,
        findings=findings + probe_found + recorded,
        notes=notes,
        work=ctx.work,
        precision_map=pmap,
        underflow=under,
        reference_fails_rule=own,
        first_nonfinite=None if located is None else tuple(loc.record() for loc in located),
        unflipped_by=None if unflipped is None else tuple(unflipped),
        local_fix=tuple(outcome.local_fix),
        reruns=tuple(outcome.reruns),
        ranking=tuple(outcome.ranking),
        suggestion=_suggestion(outcome, file),
    )


def _suggestion(outcome: Outcome, file: str) -> Suggestion | None:
    """The FP32 regions the search chose, checked by a re-run (``rule_passes``) or left unchecked by the budget."""
    chosen = outcome.chosen
    if chosen is None:
        return None
    return Suggestion(tuple(chosen.fp32_modules), True if outcome.suggestion is not None else None, file)


def probe(ctx: Context, run: Run, final_scale: float) -> tuple[PrecisionMap, Underflow]:
    """Precision map and gradient underflow on the trained reference weights and the first training batch."""
    model = ctx.model("trained").train()
    x, y = ctx.first_batch_of_update(0)
    x, y = to_device(x, ctx.device), y.to(ctx.device)
    loss = ctx.loss()
    pmap = precision_map(model, x, y, loss, run.policy, ctx.device)
    # "With the GradScaler": the scale the trial ended at, or GradScaler's initial 2**16 where it had none.
    scale = final_scale if run.policy.uses_scaler and math.isfinite(final_scale) and final_scale >= 1 else 65536.0
    under = gradient_underflow(model, x, y, loss, run.policy, ctx.device, scale, fallback=bool(pmap.missing_kernels))
    ctx.spend(traced_passes=4)
    return pmap, under
