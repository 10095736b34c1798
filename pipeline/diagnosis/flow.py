"""The whole diagnosis of one failing (or probed) trial, in the order a reader needs it."""

from __future__ import annotations

import math

from pipeline import paths, precision
from pipeline.artifacts.trial import Trajectory
from pipeline.config import Params
from pipeline.rule import RuleResult
from pipeline.diagnosis import wording
from pipeline.diagnosis.precision_map import gradient_underflow, precision_map
from pipeline.diagnosis.replay import Context, Run, load, locate, reference_fails_itself
from pipeline.diagnosis.search import Outcome, reduced_modules, search, unflip
from pipeline.diagnosis.triage import triage
from pipeline.task import to_device


def run(params: Params, dtype: str, stats: dict, trajectory: Trajectory, decision: RuleResult) -> dict:
    """Triage, then probe, replays and search as ``params.diagnose`` allows. ``decision`` is the rule's
    verdict on the trial (computed once, by the stage). ``work`` counts what it cost, in units of the
    trial's own work (deterministic, unlike seconds).

    Findings come in the order a reader needs them: where the failure starts, what fixes it, the
    suggestion, then what the probe saw, then the recorded facts triage found.
    """
    precision.strict_fp32()  # first: the probe, the replays and the FP32 side of every comparison are exact FP32, never TF32
    report = triage(stats, trajectory.steps, decision.reasons)
    ctx, trial_run, trial = load(params, dtype, stats, decision)
    cfg = params.diagnose
    probe_found: list[str] = []
    if cfg.probe == "always" or (cfg.probe == "on_failure" and report["needed"]):
        report["precision_map"], report["underflow"] = probe(ctx, trial_run, trial.trajectory.final_scale)
        probe_found, notes = wording.probe_findings(report["precision_map"], report["underflow"], trial_run.policy, ctx.device)
        report["notes"] += notes
    findings: list[str] = []
    outcome = Outcome()  # nothing searched: no fix, no re-run, no suggestion
    if report["needed"]:
        own = reference_fails_itself(ctx)
        report["reference_fails_rule"] = own
        if own:
            findings.append(wording.reference_fails_line(own))
        located = locate(ctx, trial_run)
        report["first_nonfinite"] = [loc.as_dict() for loc in located]
        findings += [wording.describe(loc, dtype) for loc in located]
        outcome = search(ctx, trial_run, located, reference_fails=bool(own))
        findings += outcome.findings
        flips = (stats.get("flips") or {}).get("flip_list") or []
        if any(not f.get("boundary") for f in flips):  # each flipped real case: which module's FP32 replay un-flips it
            order = [r["module"] for r in outcome.ranking] or reduced_modules(ctx, trial_run.policy)
            report["unflipped_by"] = unflip(ctx, trial_run, flips, order)
            findings += wording.unflip_lines(report["unflipped_by"], ctx.params.diagnose.search_budget)
    file = str(paths.diagnose(dtype) / "suggested_params.yaml")
    chosen = outcome.chosen
    report.update(
        local_fix=outcome.local_fix,
        reruns=outcome.reruns,
        ranking=outcome.ranking,
        suggestion=None
        if chosen is None
        else {"fp32_modules": list(chosen.fp32_modules), "rule_passes": True if outcome.suggestion is not None else None, "file": file},
    )
    findings += wording.suggestion_lines(outcome, file, dtype)
    if report.get("first_nonfinite"):  # the located cases say it better than the recorded counts
        report["notes"] += report["findings"]
        report["findings"] = []
    report["findings"] = findings + probe_found + report["findings"]
    report["work"] = ctx.work
    return report


def probe(ctx: Context, run: Run, final_scale: float) -> tuple[dict, dict]:
    """Precision map and gradient underflow on the trained reference weights and the first training batch."""
    model = ctx.model("trained").train()
    x, y = ctx.first_batch_of_update(0)
    x, y = to_device(x, ctx.device), y.to(ctx.device)
    loss = ctx.loss()
    pmap = precision_map(model, x, y, loss, run.policy, ctx.device)
    # "With the GradScaler": the scale the trial ended at, or GradScaler's initial 2**16 where it had none.
    scale = final_scale if run.policy.uses_scaler and math.isfinite(final_scale) and final_scale >= 1 else 65536.0
    under = gradient_underflow(model, x, y, loss, run.policy, ctx.device, scale, fallback=bool(pmap["missing_kernels"]))
    ctx.work["traced_passes"] += 4
    return pmap, under

