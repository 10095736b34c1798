"""The diagnosis in words: the lines a reviewer reads in diagnosis.json, the decision's reasons and MLflow.

Pure functions of the structured results (traces, precision map, underflow table, search outcome).
"""

from __future__ import annotations

import json
import textwrap

import torch

from pipeline.artifacts.diagnosis import PrecisionMap, Suggestion, Underflow, Unflip
from pipeline.diagnosis.trace import finite
from pipeline.diagnosis.replay import Located, Run
from pipeline.diagnosis.search import Outcome
from pipeline.config import Policy


def probe_findings(pmap: PrecisionMap, under: Underflow, policy: Policy, device: torch.device) -> tuple[list[str], list[str]]:
    """(findings, notes): what needs attention, and what a reviewer should know."""
    findings, notes = [], []
    s, dtype = pmap.summary, policy.dtype
    unit = "FLOPs" if s.share_weighted_by == "flops" else "ops"
    notes.append(
        f"precision map (one training batch of {pmap.batch}, forward and backward under {dtype}): {s.reduced_share:.1%} of "
        f"matmul-like {unit} ran in reduced precision ({s.matmul_ops_reduced} of {s.matmul_ops} ops)"
    )
    for m in pmap.missing_kernels:
        findings.append(
            f"op {m.op} has no {'/'.join(m.dtypes)} kernel on {device.type} (module '{m.module}', {m.module_type}, "
            f"{m.phase}): {m.error}; the diagnosis ran it in float32, the trial cannot: keep '{m.module}' in "
            f"the variant's fp32_modules or trial another dtype"
        )
    if pmap.error:
        findings.append(f"precision map stopped: {pmap.error}")
    if s.matmul_ops and not s.matmul_ops_reduced:
        findings.append(
            f"no matmul-like work ran in {dtype}: autocast changes nothing that matters here, so it cannot speed it up"
        )
    rows = under.parameters
    lost = sorted((r for r in rows if r.fraction_unscaled >= 0.01), key=lambda r: (-r.fraction_unscaled, r.parameter))
    kept = sorted((r for r in rows if r.fraction_scaled >= 0.01), key=lambda r: (-r.fraction_scaled, r.parameter))
    scale, total = under.scale, under.total
    worst = ", ".join(f"{r.parameter} {r.fraction_unscaled:.0%}" for r in lost[:4])
    if total.nonfinite_unscaled:
        notes.append(
            f"gradient underflow not assessed: under {dtype} {total.nonfinite_unscaled} gradient element(s) are not finite on "
            f"this batch even without loss scaling (see the first non-finite value)"
        )
    elif lost and policy.uses_scaler and not kept:
        notes.append(
            f"gradient underflow in {dtype}: without loss scaling {total.fraction_unscaled:.1%} of gradient elements are "
            f"zero where FP32's are not ({worst}); at the GradScaler's scale {scale:g}, {total.fraction_scaled:.1%}: "
            f"the scaler is what keeps them"
        )
    elif lost:
        findings.append(
            f"gradient underflow in {dtype}: {total.fraction_unscaled:.1%} of gradient elements are zero where FP32's "
            f"are not ({worst})"
            + (
                f"; at loss scale {scale:g} still {total.fraction_scaled:.1%}"
                if policy.uses_scaler
                else f"; with a loss scale of {scale:g} it would be {total.fraction_scaled:.1%}"
            )
        )
    if total.nonfinite_scaled and not total.nonfinite_unscaled:
        notes.append(
            f"at loss scale {scale:g}, {total.nonfinite_scaled} gradient element(s) overflow: the GradScaler skips "
            f"such steps and lowers its scale"
        )
    return findings, notes


def describe(loc: Located, dtype: str) -> str:
    """One line: where the first non-finite value came from, and what FP32 says about the same case."""
    c, amp, first = loc.case, loc.amp, loc.amp.first
    label = c.label + (f" ({', '.join(c.ids[:3])}{', …' if len(c.ids) > 3 else ''})" if c.ids else "")
    if c.step is not None:
        label += " (replayed from data/reference/init.safetensors in the fixed batch order"
        label += ")" if c.replay_matches_trial is not False else "; WARNING: the replay diverged from the recorded trial)"
    if finite(amp):
        return f"{label}: finite when replayed under {dtype}; the recorded failure did not reproduce"
    if first is None or first.where == "input":
        text = "the input itself is not finite"
    elif first.where == "module":
        cast = f" (autocast's cast of its input to {dtype})" if first.cast else ""
        where = (
            f"module '{first.module}' ({first.module_type}, {first.op}{cast})"
            if first.module
            else f"the model's own forward ({first.op})"
        )
        text = (
            f"the output of {where} in {first.output_dtypes}, from finite inputs "
            f"(largest |input| {first.max_abs_input:.3g}, "
            f"{first.nonfinite_elements} non-finite element(s))"
        )
    elif first.where == "loss":
        text = f"the loss ({first.op}, {first.output_dtypes}) from finite model outputs"
    else:
        where = (
            f"module '{first.module}' ({first.module_type}, "
            if first.module
            else "the loss (before any module's backward; "
        )
        text = f"a gradient, in the backward of {where}{first.op}, {first.output_dtypes}) at loss scale {c.scale:g}" + (
            f"; non-finite parameter gradients: {', '.join(amp.nonfinite_gradients[:4])}" if amp.nonfinite_gradients else ""
        )
    line = f"{label}: first non-finite value is {text}"
    if loc.unscaled is not None and finite(loc.unscaled):
        line += (
            f"; without loss scaling the gradients are finite, so the scale {c.scale:g} overflowed them: "
            f"the GradScaler skips that update and lowers its scale, as designed"
        )
    module = first.module if first and first.where == "module" else None
    if finite(loc.fp32):
        line += "; the same case in FP32 is finite"
        stat = loc.fp32.modules.get(module) if module else None
        if stat is not None:
            limit = torch.finfo(getattr(torch, dtype)).max
            line += f", '{module}' reaching {stat.max_abs:.3g}" + (
                f" ({dtype}'s largest finite value is {limit:g})" if stat.max_abs > limit else ""
            )
    else:
        line += "; the same case in FP32 is NOT finite either: the model, not autocast, produces it"
    return line


def suggestion_lines(outcome: Outcome, file: str, dtype: str) -> list[str]:
    """What the search suggests, how far it was checked, and the ranking it worked from."""
    lines = []
    chosen, suggestion, ranking = outcome.chosen, outcome.suggestion, outcome.ranking
    if chosen is not None:
        checked = (
            "a re-run of the trial under it passes the rule"
            if suggestion is not None
            else "not checked by a re-run (diagnose.search_budget)"
        )
        lines.append(
            f"suggested fp32_modules: {list(chosen.fp32_modules)} ({checked}), in {file}; "
            f"not applied: a changed policy is a new trial"
        )
    if suggestion is not None and ranking and all(r.module in suggestion.fp32_modules for r in ranking):
        lines.append(
            f"that suggestion keeps every module that runs reduced-precision matmuls ({len(ranking)}) in FP32: no matmul "
            f"work is left in {dtype}, so autocast has nothing left to gain; rolling back to FP32 is the honest choice"
        )
    if ranking:
        lines.append(
            "modules ranked by the output error their own reduced-precision work causes: "
            + ", ".join(f"{r.module} ({r.failing_elements} failing, max {r.max_abs_error:.3g})" for r in ranking[:6])
        )
    return lines


def reference_fails_line(own: list[str]) -> str:
    return (
        f"the FP32 reference fails this rule by itself ({'; '.join(own[:2])}): no precision policy can pass it; "
        f"fix the rule or the reference training, then re-freeze"
    )


def fsdp_mixed_line(policy: Policy) -> str:
    """Why a variant of FSDP2's own mixed precision gets no replay, no located op and no FP32 regions."""
    return (
        f"not replayed: FSDP2's mixed precision ({policy.fsdp_param_dtype} parameters) runs only under FSDP2's ranks, and "
        f"diagnose runs in one process, so no op is located and no FP32 region is searched; the verdict stands on "
        f"compare's evidence. To find the modules that need FP32, trial an autocast variant of the same dtype "
        f"(trial.policies.NAME.dtype: {policy.fsdp_param_dtype}): its diagnosis searches fp32_modules"
    )


def snippet(s: Suggestion, variant: str, policy: Policy) -> str:
    """The suggestion as a params.yaml fragment (the variant's whole policy, its fp32_modules changed), with how to trial it."""
    modules = json.dumps(list(s.fp32_modules))  # quoted: a module named 5 is the string '5', not YAML's integer
    entry = f"dtype: {policy.dtype}, compile: {policy.compile}, float8: {policy.float8}, fp32_modules: {modules}"
    if policy.compiled:
        entry += f", compile_mode: {policy.compile_mode}"
    checked = (
        "a re-run of the trial under it passes the acceptance rule"
        if s.rule_passes
        else "NOT checked (diagnose.search_budget ran out)"
    )
    return (
        f"# Suggested by diagnose@{variant}; not applied. Checked: {checked}.\n"
        f"# A changed policy is a new trial of {variant}: put this in params.yaml,\n"
        f"# or try it as an experiment: dvc exp run -S 'trial.policies.{variant}.fp32_modules={modules}'\n"
        f"trial:\n  policies:\n    {variant}: {{{entry}}}\n"
    )


def unflip_lines(unflipped: list[Unflip], budget: int) -> list[str]:
    """One line for the flipped real cases: the module whose FP32 replay gives each its reference class back."""
    if not unflipped:
        return []
    named = [f"{u.id} by '{u.module}'" for u in unflipped if u.module]
    missing = [u.id for u in unflipped if not u.module]
    parts = []
    if named:
        parts.append("flipped real case(s) given their reference class back by one module in FP32: " + ", ".join(named[:20]))
    if missing:
        parts.append(
            f"{len(missing)} flipped real case(s) un-flipped by no single module within diagnose.search_budget {budget}: "
            + ", ".join(missing[:10])
        )
    return parts


def compile_line(compiled: Run, eager: Run) -> str:
    """Which of the two moved the decision: the compiler (eager passes the rule) or precision (eager fails too)."""
    failed = "; ".join(textwrap.shorten(r, 160, placeholder=" …") for r in compiled.decision.reasons[:2])
    if eager.accepted:
        return (
            f"compile, not precision, moved the decision: the same policy run eager ({compiled.policy.dtype}, without "
            f"torch.compile) passes the rule, compiled it fails ({failed}). Keep this model eager, or exclude the "
            f"module that differs with torch.compiler.disable; TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 makes inductor "
            f"round its fused intermediates as eager does, to check whether that is the difference"
        )
    return (
        f"precision, not only compile: the same policy run eager ({compiled.policy.dtype}, without torch.compile) fails "
        f"the rule too ({'; '.join(textwrap.shorten(r, 160, placeholder=' …') for r in eager.decision.reasons[:2])}); "
        f"the diagnosis below is of the precision policy"
    )
