"""Diagnostics of a trial: what went wrong first, where, and which FP32 regions would fix it.

Cheap when all is well: ``triage`` reads the comparison statistics and the training record, and
nothing is replayed unless the trial fails the rule (the optional probe costs one batch). When it
fails:

1. Locate: replay the exact failing case (the failing fixed-set inputs with the trained reference
   weights; or the training step, rebuilt from ``data/reference/init.safetensors`` by replaying the
   steps before it, which is exact on CPU) with module and gradient hooks and an op recorder, and
   name the first producer of a non-finite value: input, module output, loss or gradient. The same
   case is replayed in FP32.
2. Fix locally: put the culprit module outside autocast (``Policy.fp32_modules``) and replay again,
   until the case is finite; then re-run the whole trial under that policy and apply the rule.
3. Tolerance failures: rank the modules that run reduced-precision matmuls by what each one alone
   does to the outputs, and bisect over how many of them to keep in FP32, within
   ``diagnose.search_budget`` trial re-runs.

The result is a suggestion (``trial.fp32_modules``), written beside the report and never applied.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from pipeline import checkpoint, comparison, devices, numerics, paths, reference, task, training, verdict
from pipeline.artifacts import read_json, read_tensors
from pipeline.config import AcceptanceConfig, Params
from pipeline.precision import Policy
from pipeline.precision_map import (
    ModuleScope,
    Recorder,
    culprit,
    finite,
    forward_backward,
    gradient_underflow,
    precision_map,
    trace,
)

FP32 = Policy()


def triage(stats: dict, trial_steps: list[dict], rule: AcceptanceConfig) -> dict:
    """Findings from the recorded statistics alone: non-finite outputs by case kind, first non-finite
    training step, and the rule's own verdict (``needed``: the trial fails it)."""
    findings: list[str] = []
    for name, gap in sorted(stats["values"].items()):
        for kind, g in sorted(gap["per_kind"].items()):
            if g["nonfinite_trial_only"]:
                findings.append(f"output '{name}' is non-finite on {g['nonfinite_trial_only']} element(s) of {kind} cases")
    first_loss = first_nonfinite_step(trial_steps, "loss")
    if first_loss is not None:
        findings.append(f"first non-finite loss at training step {first_loss}")
    first_grad = first_nonfinite_step(trial_steps, "grad_norm")
    if first_grad is not None:
        findings.append(f"first non-finite gradient norm at training step {first_grad} (the scaler skips such updates)")
    failing = verdict.decide(stats, rule)["reasons"]
    return {"findings": findings, "notes": [], "needed": bool(failing), "failing": failing}


def first_nonfinite_step(steps: list[dict], key: str = "") -> int | None:
    keys = (key,) if key else ("loss", "grad_norm")
    return next((s["step"] for s in steps if any(not math.isfinite(s[k]) for k in keys)), None)


@dataclass
class Run:
    """One trial's results: the original (from its files) or a re-run under another policy."""

    policy: Policy
    outputs: dict[str, torch.Tensor]
    steps: list[dict]
    stats: dict
    decision: dict = field(default_factory=dict)


@dataclass
class Context:
    params: Params
    dtype: str
    device: torch.device
    ref: reference.Reference
    train_x: torch.Tensor
    train_y: torch.Tensor
    work: dict = field(default_factory=lambda: {"replayed_steps": 0, "traced_passes": 0, "trial_reruns": 0})

    def model(self, state: str) -> torch.nn.Module:
        """The task's model in the reference's ``trained`` state (weights only) or ``init`` state (weights and RNG)."""
        model = task.build_model(self.params.task, self.params.seed)
        if state == "init":
            checkpoint.restore(self.ref.checkpoint("init"), model)
        else:
            checkpoint.restore(self.ref.checkpoint(), model, rng=False)
        return model.to(self.device)

    def loss_fn(self):
        return training.loss_function(self.params.task.loss)


@dataclass
class Case:
    """A replayable case: model state, inputs, RNG state and loss scale, frozen so every policy sees the same."""

    label: str
    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor | None
    loss_fn: object
    scale: float
    rng: tuple
    ids: list[str] = field(default_factory=list)
    step: int | None = None
    replay_matches_trial: bool | None = None

    def trace(self, ctx: Context, policy: Policy, scale: float | None = None) -> dict:
        set_rng(self.rng)
        ctx.work["traced_passes"] += 1
        return trace(self.model, self.x, self.y, self.loss_fn, policy, ctx.device, self.scale if scale is None else scale)


def get_rng(device: torch.device) -> tuple:
    """The RNG state a replay starts from (dropout draws from it): CPU, and the GPU's when one runs."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def inference_case(ctx: Context, run: Run) -> Case | None:
    """The fixed-set cases where the run's outputs are non-finite and the reference's are not."""
    bad = torch.zeros(len(ctx.ref.cases.ids), dtype=torch.bool)
    for name, out in run.outputs.items():
        ref = ctx.ref.outputs[name].reshape(out.shape[0], -1)
        bad |= (~torch.isfinite(out.reshape(out.shape[0], -1)) & torch.isfinite(ref)).any(dim=1)
    idx = torch.nonzero(bad).flatten()[: ctx.params.diagnose.max_cases]
    if idx.numel() == 0:
        return None
    model = ctx.model("trained")
    model.train(not ctx.params.reference.eval_mode)
    ids = [ctx.ref.cases.ids[i] for i in idx.tolist()]
    return Case(
        f"inference on {len(ids)} failing case(s)", model, ctx.ref.cases.x[idx], None, None, 1.0, get_rng(ctx.device), ids=ids
    )


def training_case(ctx: Context, run: Run, step: int) -> Case:
    """Training step ``step`` exactly as the run met it: the steps before it are replayed from the
    reference's initial state (weights and RNG) under the run's policy, in the fixed batch order."""
    model = ctx.model("init")
    cfg = replace(ctx.params.reference, train_steps=step, checkpoint_every=0)
    result = training.train(
        model,
        ctx.train_x,
        ctx.train_y,
        cfg,
        ctx.params.task.loss,
        run.policy,
        ctx.device,
        ctx.params.seed,
        label=f"diagnose replay {ctx.dtype}",
    )
    ctx.work["replayed_steps"] += step
    replayed = [r.loss for r in result.records]
    recorded = [s["loss"] for s in run.steps[:step]]
    matches = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(replayed, recorded))
    scale = float(result.final_scale) if run.policy.uses_scaler else 1.0
    ref_cfg = ctx.params.reference
    idx = training.batch_order(ctx.train_x.shape[0], ref_cfg.batch_size, ref_cfg.train_steps, ctx.params.seed)[step]
    return Case(
        f"training step {step}",
        model,
        ctx.train_x[idx],
        ctx.train_y[idx],
        ctx.loss_fn(),
        scale,
        get_rng(ctx.device),
        step=step,
        replay_matches_trial=matches,
    )


@dataclass
class Located:
    """A failing case traced under the run's policy, under FP32, and (for a gradient failure at a loss
    scale above 1) without scaling, which separates a scale that overflowed from a real overflow."""

    case: Case
    amp: dict
    fp32: dict
    unscaled: dict | None = None

    @property
    def autocast_problem(self) -> bool:
        return not finite(self.amp) and not (self.unscaled is not None and finite(self.unscaled))

    def as_dict(self) -> dict:
        c = self.case
        return {
            "case": c.label,
            "ids": c.ids,
            "step": c.step,
            "scale": c.scale,
            "replay_matches_trial": c.replay_matches_trial,
            "amp": self.amp,
            "fp32": self.fp32,
            "unscaled": self.unscaled,
        }


def locate(ctx: Context, run: Run) -> list[Located]:
    """Each failing case of ``run``, traced."""
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
        first = amp["first"] or {}
        unscaled = c.trace(ctx, run.policy, scale=1.0) if first.get("where") == "gradient" and c.scale != 1.0 else None
        located.append(Located(c, amp, c.trace(ctx, FP32, scale=1.0), unscaled))
    return located


def rerun(ctx: Context, policy: Policy) -> Run:
    """The trial again under ``policy``, as trial@DTYPE runs it, then compare and the rule."""
    params, ref = ctx.params, ctx.ref
    run = training.run_trial(
        ctx.model("trained"),
        lambda: ctx.model("init"),
        ctx.train_x,
        ctx.train_y,
        ref.cases.x,
        params.reference,
        params.task.loss,
        policy,
        ctx.device,
        params.seed,
        label=f"diagnose re-run {ctx.dtype}",
    )
    outputs, result, trained = run.outputs, run.training, run.trained_outputs
    steps = [asdict(r) for r in result.records]
    stats = comparison.compare(
        params.task.kind,
        params.acceptance,
        ref.cases,
        ref.outputs,
        outputs,
        trained,
        ref.trajectory,
        steps,
        result.final_scale,
        scaler_enabled=policy.uses_scaler,
    )
    ctx.work["trial_reruns"] += 1
    return Run(policy, outputs, steps, stats, verdict.decide(stats, params.acceptance))


def reference_fails_itself(ctx: Context) -> list[str]:
    """Reasons the rule rejects the FP32 reference compared with itself: no precision policy can fix those."""
    ref = ctx.ref
    stats = comparison.compare(
        ctx.params.task.kind,
        ctx.params.acceptance,
        ref.cases,
        ref.outputs,
        ref.outputs,
        ref.outputs,
        ref.trajectory,
        ref.trajectory,
        math.inf,
    )
    return verdict.decide(stats, ctx.params.acceptance)["reasons"]


def with_modules(policy: Policy, names: list[str]) -> Policy:
    """``policy`` plus ``names`` outside autocast, dropping modules already inside a listed ancestor."""
    merged = list(policy.fp32_modules) + [n for n in names if n not in policy.fp32_modules]
    kept = [n for n in merged if not any(a != n and n.startswith(a + ".") for a in merged)]
    return replace(policy, fp32_modules=tuple(kept))


def fix_nonfinite(ctx: Context, located: list[Located], policy: Policy) -> tuple[Policy, bool, list[dict]]:
    """Add each case's culprit to the FP32 regions and replay, until every case is finite or no culprit is left."""
    cases = [loc.case for loc in located if loc.autocast_problem]
    traces = [loc.amp for loc in located if loc.autocast_problem]
    steps = []
    for _ in range(sum(1 for _ in cases[0].model.modules()) if cases else 0):  # each round adds a module, or stops
        new = sorted({c for t in traces if not finite(t) and (c := culprit(t)) and c not in policy.fp32_modules})
        if not new:
            break
        policy = with_modules(policy, new)
        traces = [case.trace(ctx, policy) for case in cases]
        steps.append(
            {
                "fp32_modules": list(policy.fp32_modules),
                "cases_finite": [finite(t) for t in traces],
                "first": [t["first"] for t in traces],
            }
        )
    return policy, all(finite(t) for t in traces), steps


def rank_modules(ctx: Context, policy: Policy) -> list[dict]:
    """Modules that run reduced-precision matmul work themselves, ranked by what each one alone does to
    the outputs on the fixed set: it stays under autocast, every other candidate runs in FP32, and the
    outputs are held against the reference with the rule's tolerances (failing elements, then max error)."""
    model = ctx.model("trained")
    model.train(not ctx.params.reference.eval_mode)
    scope = ModuleScope(model)
    recorder = Recorder(scope, watch_nonfinite=False)
    with torch.no_grad(), scope, recorder:
        forward_backward(model, ctx.ref.cases.x[:256].to(ctx.device), None, None, policy, ctx.device, scope)
    names = [n for n, m in recorder.matmul_by_module().items() if n and m["reduced_count"] and n not in policy.fp32_modules]
    ranked = []
    for name in names:
        others = [o for o in names if o != name and not name.startswith(o + ".") and not o.startswith(name + ".")]
        out = training.infer(model, ctx.ref.cases.x, with_modules(policy, others), ctx.device, ctx.params.reference.eval_mode)
        gaps = [
            numerics.value_gaps(
                ctx.ref.outputs[k], out[k], ctx.params.acceptance.tolerance(k).atol, ctx.params.acceptance.tolerance(k).rtol
            )
            for k in sorted(ctx.ref.outputs)
        ]
        ranked.append(
            {
                "module": name,
                "type": type(dict(model.named_modules())[name]).__name__,
                "failing_elements": sum(g["failing"] for g in gaps),
                "max_abs_error": max(g["max_abs"] for g in gaps),
            }
        )
    return sorted(ranked, key=lambda r: (-r["failing_elements"], -r["max_abs_error"], r["module"]))


def search_tolerance(ctx: Context, base: Policy, history: list[dict], ranking: list[dict]) -> Policy | None:
    """Bisect over the ranked modules for the shortest prefix in FP32 that passes the rule, then try
    dropping the others one by one, all within ``diagnose.search_budget`` trial re-runs."""
    ranking += rank_modules(ctx, base)
    names = [r["module"] for r in ranking]

    def passes(chosen: list[str]) -> bool:
        run = rerun(ctx, with_modules(base, chosen))
        history.append(summary(run))
        return run.decision["decision"] == "accept"

    def budget_left() -> bool:
        return ctx.work["trial_reruns"] < ctx.params.diagnose.search_budget

    if not names or not passes(names):
        return None
    lo, hi = 0, len(names)  # the trial itself (none in FP32) fails; all of them passes
    while hi - lo > 1 and budget_left():
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(names[:mid]) else (mid, hi)
    chosen = names[:hi]
    for name in reversed(chosen[:-1] if hi - lo == 1 else chosen):  # names[:hi-1] is known to fail when hi - lo == 1
        if not budget_left():
            break
        if passes([n for n in chosen if n != name]):
            chosen.remove(name)
    return with_modules(base, chosen)


def has_nonfinite(run: Run) -> bool:
    return first_nonfinite_step(run.steps) is not None or any(g["nonfinite_trial_only"] for g in run.stats["values"].values())


def summary(run: Run) -> dict:
    return {
        "fp32_modules": list(run.policy.fp32_modules),
        "decision": run.decision["decision"],
        "reasons": run.decision["reasons"],
    }


def load(params: Params, dtype: str, stats: dict, trajectory: dict) -> tuple[Context, Run]:
    """The reference, the training data and the trial's own results, each checked against its manifest."""
    ref = reference.load(params)
    train_t, _ = read_tensors(paths.PREPARED_TRAIN, ref.manifest["files"][str(paths.PREPARED_TRAIN)], "prepare")
    ctx = Context(params, dtype, devices.resolve(params.device), ref, train_t["x"], train_t["y"])
    manifest = read_json(paths.trial(dtype) / "manifest.json", f"trial@{dtype}")
    outputs = read_tensors(
        paths.trial(dtype) / "outputs.safetensors", manifest["files"]["outputs.safetensors"], f"trial@{dtype}"
    )[0]
    policy = Policy(dtype=dtype, fp32_modules=tuple(manifest["policy"]["fp32_modules"]))
    return ctx, Run(policy, outputs, trajectory["steps"], stats, verdict.decide(stats, params.acceptance))


def probe(ctx: Context, run: Run, final_scale: float) -> tuple[dict, dict]:
    """Precision map and gradient underflow on the trained reference weights and the first training batch."""
    model = ctx.model("trained").train()
    cfg = ctx.params.reference
    idx = training.batch_order(ctx.train_x.shape[0], cfg.batch_size, 1, ctx.params.seed)[0]
    x, y = ctx.train_x[idx].to(ctx.device), ctx.train_y[idx].to(ctx.device)
    pmap = precision_map(model, x, y, ctx.loss_fn(), run.policy, ctx.device)
    # "With the GradScaler": the scale the trial ended at, or GradScaler's initial 2**16 where it had none.
    scale = final_scale if run.policy.uses_scaler and math.isfinite(final_scale) and final_scale >= 1 else 65536.0
    under = gradient_underflow(model, x, y, ctx.loss_fn(), run.policy, ctx.device, scale, fallback=bool(pmap["missing_kernels"]))
    ctx.work["traced_passes"] += 4
    return pmap, under


def probe_findings(pmap: dict, under: dict, policy: Policy, device: torch.device) -> tuple[list[str], list[str]]:
    """(findings, notes): what needs attention, and what a reviewer should know."""
    findings, notes = [], []
    s, dtype = pmap["summary"], policy.dtype
    unit = "FLOPs" if s["share_weighted_by"] == "flops" else "ops"
    notes.append(
        f"precision map (one training batch of {pmap['batch']}, forward and backward under {dtype}): {s['reduced_share']:.1%} of "
        f"matmul-like {unit} ran in reduced precision ({s['matmul_ops_reduced']} of {s['matmul_ops']} ops)"
    )
    for m in pmap["missing_kernels"]:
        findings.append(
            f"op {m['op']} has no {'/'.join(m['dtypes'])} kernel on {device.type} (module '{m['module']}', {m['module_type']}, "
            f"{m['phase']}): {m['error']}; the diagnosis ran it in float32, the trial cannot: keep '{m['module']}' in "
            f"trial.fp32_modules or trial another dtype"
        )
    if pmap["error"]:
        findings.append(f"precision map stopped: {pmap['error']}")
    if s["matmul_ops"] and not s["matmul_ops_reduced"]:
        findings.append(
            f"no matmul-like work ran in {dtype}: autocast changes nothing that matters here, so it cannot speed it up"
        )
    rows = under["parameters"]
    lost = sorted((r for r in rows if r["fraction_unscaled"] >= 0.01), key=lambda r: (-r["fraction_unscaled"], r["parameter"]))
    kept = sorted((r for r in rows if r["fraction_scaled"] >= 0.01), key=lambda r: (-r["fraction_scaled"], r["parameter"]))
    scale, total = under["scale"], under["total"]
    worst = ", ".join(f"{r['parameter']} {r['fraction_unscaled']:.0%}" for r in lost[:4])
    if total["nonfinite_unscaled"]:
        notes.append(
            f"gradient underflow not assessed: under {dtype} {total['nonfinite_unscaled']} gradient element(s) are not finite on "
            f"this batch even without loss scaling (see the first non-finite value)"
        )
    elif lost and policy.uses_scaler and not kept:
        notes.append(
            f"gradient underflow in {dtype}: without loss scaling {total['fraction_unscaled']:.1%} of gradient elements are "
            f"zero where FP32's are not ({worst}); at the GradScaler's scale {scale:g}, {total['fraction_scaled']:.1%}: "
            f"the scaler is what keeps them"
        )
    elif lost:
        findings.append(
            f"gradient underflow in {dtype}: {total['fraction_unscaled']:.1%} of gradient elements are zero where FP32's "
            f"are not ({worst})"
            + (
                f"; at loss scale {scale:g} still {total['fraction_scaled']:.1%}"
                if policy.uses_scaler
                else f"; with a loss scale of {scale:g} it would be {total['fraction_scaled']:.1%}"
            )
        )
    if total["nonfinite_scaled"] and not total["nonfinite_unscaled"]:
        notes.append(
            f"at loss scale {scale:g}, {total['nonfinite_scaled']} gradient element(s) overflow: the GradScaler skips "
            f"such steps and lowers its scale"
        )
    return findings, notes


def describe(loc: Located, dtype: str) -> str:
    """One line: where the first non-finite value came from, and what FP32 says about the same case."""
    c, amp, first = loc.case, loc.amp, loc.amp["first"]
    label = c.label + (f" ({', '.join(c.ids[:3])}{', …' if len(c.ids) > 3 else ''})" if c.ids else "")
    if c.step is not None:
        label += " (replayed from data/reference/init.safetensors in the fixed batch order"
        label += ")" if c.replay_matches_trial is not False else "; WARNING: the replay diverged from the recorded trial)"
    if finite(amp):
        return f"{label}: finite when replayed under {dtype}; the recorded failure did not reproduce"
    if first is None or first["where"] == "input":
        text = "the input itself is not finite"
    elif first["where"] == "module":
        cast = f" (autocast's cast of its input to {dtype})" if first["cast"] else ""
        where = (
            f"module '{first['module']}' ({first['module_type']}, {first['op']}{cast})"
            if first["module"]
            else f"the model's own forward ({first['op']})"
        )
        text = (
            f"the output of {where} in {first['output_dtypes']}, from finite inputs "
            f"(largest |input| {first['max_abs_input']:.3g}, "
            f"{first['nonfinite_elements']} non-finite element(s))"
        )
    elif first["where"] == "loss":
        text = f"the loss ({first['op']}, {first['output_dtypes']}) from finite model outputs"
    else:
        where = (
            f"module '{first['module']}' ({first['module_type']}, "
            if first["module"]
            else "the loss (before any module's backward; "
        )
        text = f"a gradient, in the backward of {where}{first['op']}, {first['output_dtypes']}) at loss scale {c.scale:g}" + (
            f"; non-finite parameter gradients: {', '.join(amp['nonfinite_gradients'][:4])}" if amp["nonfinite_gradients"] else ""
        )
    line = f"{label}: first non-finite value is {text}"
    if loc.unscaled is not None and finite(loc.unscaled):
        line += (
            f"; without loss scaling the gradients are finite, so the scale {c.scale:g} overflowed them: "
            f"the GradScaler skips that update and lowers its scale, as designed"
        )
    module = first["module"] if first and first["where"] == "module" else None
    if finite(loc.fp32):
        line += "; the same case in FP32 is finite"
        peak = loc.fp32["modules"].get(module, {}).get("max_abs") if module else None
        if peak is not None:
            limit = torch.finfo(getattr(torch, dtype)).max
            line += f", '{module}' reaching {peak:.3g}" + (
                f" ({dtype}'s largest finite value is {limit:g})" if peak > limit else ""
            )
    else:
        line += "; the same case in FP32 is NOT finite either: the model, not autocast, produces it"
    return line


def diagnose(ctx: Context, run: Run, report: dict, final_scale: float) -> dict:
    """Fill ``report`` (from ``triage``): probe, locate, fix locally, search, suggest.

    Findings come in the order a reader needs them: where the failure starts, what fixes it, the
    suggestion, then what the probe saw, then the recorded facts ``triage`` found.
    """
    cfg, dtype = ctx.params.diagnose, ctx.dtype
    findings, probe_found, history, local, ranking = [], [], [], [], []
    if cfg.probe == "always" or (cfg.probe == "on_failure" and report["needed"]):
        report["precision_map"], report["underflow"] = probe(ctx, run, final_scale)
        probe_found, notes = probe_findings(report["precision_map"], report["underflow"], run.policy, ctx.device)
        report["notes"] += notes
    current, suggestion, unchecked = run, None, None
    if report["needed"]:
        own = reference_fails_itself(ctx)
        report["reference_fails_rule"] = own
        if own:
            findings.append(
                f"the FP32 reference fails this rule by itself ({'; '.join(own[:2])}): no precision policy can pass it; "
                f"fix the rule or the reference training, then re-freeze"
            )
        located = locate(ctx, run)
        report["first_nonfinite"] = [loc.as_dict() for loc in located]
        findings += [describe(loc, dtype) for loc in located]
        while True:
            budget_left = ctx.work["trial_reruns"] < cfg.search_budget
            if located:
                policy, ok, steps = fix_nonfinite(ctx, located, current.policy)
                local.append(
                    {
                        "from": list(current.policy.fp32_modules),
                        "to": list(policy.fp32_modules),
                        "cases_finite": ok,
                        "steps": steps,
                    }
                )
                if policy == current.policy:
                    findings.append(
                        "no module to move out of autocast: the non-finite values do not come from a module's "
                        "reduced-precision work"
                    )
                    break
                added = ", ".join(repr(m) for m in policy.fp32_modules if m not in current.policy.fp32_modules)
                findings.append(
                    f"with {added} outside autocast (inputs cast to float32) the replayed case(s) are "
                    f"{'finite' if ok else 'still not finite'}"
                )
                if not budget_left:
                    unchecked = policy if ok else None
                    break
                current = rerun(ctx, policy)
                history.append(summary(current))
                if current.decision["decision"] == "accept":
                    suggestion = policy
                    break
                findings.append(
                    f"a re-run with trial.fp32_modules {list(policy.fp32_modules)} still fails: "
                    f"{'; '.join(current.decision['reasons'][:2])}"
                )
                located = locate(ctx, current) if has_nonfinite(current) else []
            elif own or not budget_left:
                break
            else:
                suggestion = search_tolerance(ctx, current.policy, history, ranking)
                if suggestion is None:
                    findings.append(
                        "no FP32 region passes the rule within diagnose.search_budget"
                        if ranking
                        else "no module runs reduced-precision matmuls: no FP32 region to suggest"
                    )
                break
    report.update(local_fix=local, reruns=history, ranking=ranking)
    chosen = suggestion or unchecked
    report["suggestion"] = (
        None
        if chosen is None
        else {
            "fp32_modules": list(chosen.fp32_modules),
            "rule_passes": True if suggestion is not None else None,
            "file": str(paths.diagnose(dtype) / "suggested_params.yaml"),
        }
    )
    if chosen is not None:
        checked = (
            "a re-run of the trial under it passes the rule"
            if suggestion is not None
            else "not checked by a re-run (diagnose.search_budget)"
        )
        findings.append(
            f"suggested trial.fp32_modules: {list(chosen.fp32_modules)} ({checked}), in {report['suggestion']['file']}; "
            f"not applied: a changed policy is a new trial"
        )
    if suggestion is not None and ranking and all(r["module"] in suggestion.fp32_modules for r in ranking):
        findings.append(
            f"that suggestion keeps every module that runs reduced-precision matmuls ({len(ranking)}) in FP32: no matmul "
            f"work is left in {dtype}, so autocast has nothing left to gain; rolling back to FP32 is the honest choice"
        )
    if ranking:
        findings.append(
            "modules ranked by the output error their own reduced-precision work causes: "
            + ", ".join(f"{r['module']} ({r['failing_elements']} failing, max {r['max_abs_error']:.3g})" for r in ranking[:6])
        )
    if report.get("first_nonfinite"):  # the located cases say it better than the recorded counts
        report["notes"] += report["findings"]
        report["findings"] = []
    report["findings"] = findings + probe_found + report["findings"]
    return report


def snippet(report: dict, dtype: str) -> str:
    """The suggestion as a params.yaml fragment, with how to trial it."""
    s = report["suggestion"]
    modules = "[" + ", ".join(s["fp32_modules"]) + "]"
    checked = (
        "a re-run of the trial under it passes the acceptance rule"
        if s["rule_passes"]
        else "NOT checked (diagnose.search_budget ran out)"
    )
    return (
        f"# Suggested by diagnose@{dtype}; not applied. Checked: {checked}.\n"
        f"# A changed policy is a new trial: put this in params.yaml (it applies to every dtype in trial.dtypes),\n"
        f"# or try it as an experiment: dvc exp run -S 'trial.fp32_modules={modules}'\n"
        f"trial:\n  fp32_modules: {modules}\n"
    )


def run(params: Params, dtype: str, stats: dict, trajectory: dict) -> dict:
    """The whole diagnosis of one trial: triage, then probe, replays and search as ``params.diagnose`` allows.
    ``work`` counts what it cost, in units of the trial's own work (deterministic, unlike seconds)."""
    report = triage(stats, trajectory["steps"], params.acceptance)
    ctx, trial = load(params, dtype, stats, trajectory)
    report = diagnose(ctx, trial, report, trajectory["final_scale"])
    report["work"] = ctx.work
    return report
