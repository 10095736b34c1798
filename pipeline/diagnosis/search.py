"""Finding FP32 regions that make a failing trial pass: fix non-finite values locally, then search.

``search`` is the whole strategy, in the order it runs:

1. while replayed cases are non-finite: move each culprit module out of autocast, replay until finite,
   re-run the trial under that policy; stop on accept, on a re-run that leaves no non-finite value (go
   to 2), or when the budget or the culprits run out;
2. a tolerance failure (no non-finite value left): rank the modules doing reduced-precision matmuls and
   bisect over how many to keep in FP32 (``search_tolerance``).

No candidate is re-run, nor suggested, that leaves less than ``acceptance.min_amp_share`` of the FLOPs in reduced
precision (``short_of_share``: its audit, two traced passes): such a variant is rolled back by the rule whatever its
numerics, so FP32 regions that need it are no fix, and the finding says so. Every re-run counts against
``diagnose.search_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pipeline import inference, rule, task

from pipeline.compare.decisions import labels_of
from pipeline.compare.gaps import value_gaps
from pipeline.artifacts.comparison import Flip
from pipeline.artifacts.diagnosis import FixStep, LocalFix, Ranked, Rerun, Unflip
from pipeline.diagnosis.precision_map import ModuleScope, Recorder, forward_backward
from pipeline.diagnosis.trace import culprit, finite
from pipeline.diagnosis.replay import Context, Located, Run, engaged, locate, rerun
from pipeline.config import Policy
from pipeline.heads import decided_heads, judged, primary_name, score_heads


@dataclass
class Outcome:
    """What the search found and what it cost; ``suggestion`` passed the rule in a re-run, ``unchecked`` did not run."""

    findings: list[str] = field(default_factory=list)
    local_fix: list[LocalFix] = field(default_factory=list)
    reruns: list[Rerun] = field(default_factory=list)
    ranking: list[Ranked] = field(default_factory=list)
    suggestion: Policy | None = None
    unchecked: Policy | None = None
    short_of_share: bool = False
    """Every FP32 region that could pass leaves too little work in reduced precision (a finding says which)."""

    @property
    def chosen(self) -> Policy | None:
        return self.suggestion or self.unchecked


def search(ctx: Context, run: Run, located: list[Located], reference_fails: bool) -> Outcome:
    """Fix the located non-finite cases, then (tolerance failures) search the ranked modules; see the module doc."""
    out = Outcome()
    current = run
    while located:
        policy, ok, steps = fix_nonfinite(ctx, located, current.policy)
        out.local_fix.append(LocalFix(tuple(current.policy.fp32_modules), tuple(policy.fp32_modules), ok, tuple(steps)))
        if policy == current.policy:
            out.findings.append(
                "no module to move out of autocast: the non-finite values do not come from a module's reduced-precision work"
            )
            return out
        added = ", ".join(repr(m) for m in policy.fp32_modules if m not in current.policy.fp32_modules)
        out.findings.append(
            f"with {added} outside autocast (inputs cast to float32) the replayed case(s) are "
            f"{'finite' if ok else 'still not finite'}"
        )
        if short_of_share(ctx, policy):
            out.findings.append(no_region(ctx, policy, f"the non-finite values need {added} outside autocast"))
            out.short_of_share = True
            return out
        if not ctx.budget_left:
            out.unchecked = policy if ok else None
            return out
        current = rerun(ctx, policy)
        out.reruns.append(current.summary())
        if current.accepted:
            out.suggestion = policy
            return out
        out.findings.append(
            f"a re-run with fp32_modules {list(policy.fp32_modules)} still fails: {'; '.join(current.decision.reasons[:2])}"
        )
        located = locate(ctx, current) if current.has_nonfinite else []
    if reference_fails or not ctx.budget_left:
        return out
    out.suggestion = search_tolerance(ctx, current.policy, out)
    if out.suggestion is None and not out.short_of_share:
        out.findings.append(
            "no FP32 region passes the rule within diagnose.search_budget"
            if out.ranking
            else "no module runs reduced-precision matmuls: no FP32 region to suggest"
        )
    return out


def short_of_share(ctx: Context, policy: Policy) -> bool:
    """Whether ``policy`` runs less of the FLOPs in reduced precision than the rule's ``min_amp_share`` (null: never)."""
    rule_ = ctx.params.acceptance
    return rule_.min_amp_share is not None and rule.amp_share(engaged(ctx, policy), rule_) is not None


def no_region(ctx: Context, policy: Policy, why: str) -> str:
    """The one-line finding when the FP32 regions that would pass leave too little in reduced precision."""
    dtype = rule.reduced_dtype(policy)
    return (f"no FP32 region that keeps at least {100 * ctx.params.acceptance.min_amp_share:g} % of the FLOPs in {dtype} "
            f"passes the rule: {why}, which leaves {100 * rule.gained(engaged(ctx, policy)):.1f} % of the matmul, "
            f"convolution and attention FLOPs in {dtype}; keep the FP32 reference (acceptance.min_amp_share)")


def with_modules(policy: Policy, names: list[str]) -> Policy:
    """``policy`` plus ``names`` outside autocast, dropping modules already inside a listed ancestor."""
    merged = list(policy.fp32_modules) + [n for n in names if n not in policy.fp32_modules]
    kept = [n for n in merged if not any(a != n and n.startswith(a + ".") for a in merged)]
    return replace(policy, fp32_modules=tuple(kept))


def fix_nonfinite(ctx: Context, located: list[Located], policy: Policy) -> tuple[Policy, bool, list[FixStep]]:
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
        steps.append(FixStep(tuple(policy.fp32_modules), tuple(finite(t) for t in traces), tuple(t.first for t in traces)))
    return policy, all(finite(t) for t in traces), steps


def reduced_modules(ctx: Context, policy: Policy) -> list[str]:
    """Modules that run reduced-precision matmul work themselves under ``policy`` (on up to 256 fixed-set cases)."""
    model = ctx.model("trained")
    model.train(not ctx.params.reference.eval_mode)
    scope = ModuleScope(model)
    recorder = Recorder(scope, watch_nonfinite=False)
    sample = task.take(ctx.ref.cases.x, torch.arange(min(256, len(ctx.ref.cases.ids))))
    with torch.no_grad(), scope, recorder:
        forward_backward(model, task.to_device(sample, ctx.device), None, None, policy, ctx.device, scope)
    return [n for n, m in recorder.matmul_by_module().items() if n and m.reduced_count and n not in policy.fp32_modules]


def unflip(ctx: Context, run: Run, flips: tuple[Flip, ...], order: list[str]) -> list[Unflip]:
    """For each flipped REAL case (per case, not per token), the first module whose FP32 replay alone gives the
    reference's class back: the trained reference re-run on those cases with that one module outside autocast.
    Modules are tried in ``order`` (the ranking, else every module doing reduced-precision matmuls), at most
    ``diagnose.search_budget`` of them: inference passes over the flipped cases only, cheap beside a re-run."""
    real = [f for f in flips if not f.boundary and f.position is None]
    if not real:
        return []
    index = {cid: i for i, cid in enumerate(ctx.ref.cases.ids)}
    rows = torch.tensor([index[f.id] for f in real])
    x = task.take(ctx.ref.cases.x, rows)
    want = torch.tensor([int(f.reference_class) for f in real])
    model = ctx.model("trained")
    found: dict[str, str] = {}
    for name in order[: max(ctx.params.diagnose.search_budget, 1)]:
        out = inference.infer(model, x, with_modules(run.policy, [name]), ctx.device, ctx.params.reference.eval_mode)
        labels = labels_of(task.primary(out), ctx.params.acceptance.tie_rule)
        for f, ok in zip(real, (labels == want).tolist()):
            if ok and f.id not in found:
                found[f.id] = name
        if len(found) == len(real):
            break
    return [Unflip(f.id, found.get(f.id)) for f in real]


def rank_modules(ctx: Context, policy: Policy) -> list[Ranked]:
    """Modules that run reduced-precision matmul work themselves, ranked by what each one alone does to
    the outputs on the fixed set: it stays under autocast, every other candidate runs in FP32, and the
    outputs are held against the reference with the rule's tolerances (failing elements, then max error)."""
    model = ctx.model("trained")
    model.train(not ctx.params.reference.eval_mode)
    cases_x = ctx.ref.cases.x
    names = reduced_modules(ctx, policy)
    shapes = {k: tuple(v.shape) for k, v in ctx.ref.outputs.items()}
    kind, rule, main = ctx.params.task.kind, ctx.params.acceptance, primary_name(shapes)
    roles = ctx.ref.manifest.output_roles()  # freeze's table, as compare judged the trial
    if roles is not None:
        heads, scores = roles.judged_as()[:2]
    else:  # (a reference frozen before roles were recorded)
        heads, scores = decided_heads(kind, rule, shapes, main), score_heads(kind, rule, shapes, main)
    ranked = []
    for name in names:
        others = [o for o in names if o != name and not name.startswith(o + ".") and not o.startswith(name + ".")]
        out = inference.infer(model, cases_x, with_modules(policy, others), ctx.device, ctx.params.reference.eval_mode)
        tolerance = ctx.params.acceptance.tolerance
        gaps = [value_gaps(ctx.ref.outputs[k], out[k], tolerance(k).atol, tolerance(k).rtol, softmax=k in heads,
                           scores_only=k in scores)
                for k in judged(rule, sorted(ctx.ref.outputs))]  # (role ignored: not judged)
        ranked.append(
            Ranked(
                module=name,
                type=type(dict(model.named_modules())[name]).__name__,
                failing_elements=sum(g.failing for g in gaps),
                max_abs_error=max(g.max_abs for g in gaps),
            )
        )
    return sorted(ranked, key=lambda r: (-r.failing_elements, -r.max_abs_error, r.module))


def search_tolerance(ctx: Context, base: Policy, out: Outcome) -> Policy | None:
    """Bisect over the ranked modules for the shortest prefix in FP32 that passes the rule, then try
    dropping the others one by one, all within ``diagnose.search_budget`` trial re-runs. Prefixes that leave less
    than ``min_amp_share`` of the FLOPs in reduced precision are never run (``_most_in_fp32``)."""
    out.ranking += rank_modules(ctx, base)
    names = [r.module for r in out.ranking]
    failed: list[str] = []

    def passes(chosen: list[str]) -> bool:
        run = rerun(ctx, with_modules(base, chosen))
        out.reruns.append(run.summary())
        failed[:] = run.decision.reasons[:2]
        return run.accepted

    if not names:
        return None
    cap = _most_in_fp32(ctx, base, names)
    if cap < 1:
        out.short_of_share = True
        why = (f"the policy's own fp32_modules {list(base.fp32_modules)}" if cap < 0
               else f"{names[0]!r}, the top-ranked module, in FP32 alone")
        out.findings.append(no_region(ctx, with_modules(base, names[:1]) if cap == 0 else base, why))
        return None
    if not passes(names[:cap]):
        if cap < len(names):  # what passes, if anything, needs more in FP32 than the share allows
            out.short_of_share = True
            out.findings.append(no_region(ctx, with_modules(base, names[: cap + 1]),
                                          f"a re-run with the {cap} top-ranked module(s) in FP32 still fails "
                                          f"({'; '.join(failed)}), and the next, {names[cap]!r}, in FP32 too"))
        return None
    names = names[:cap]
    lo, hi = 0, len(names)  # the trial itself (none in FP32) fails; all of them passes
    while hi - lo > 1 and ctx.budget_left:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(names[:mid]) else (mid, hi)
    chosen = names[:hi]
    for name in reversed(chosen[:-1] if hi - lo == 1 else chosen):  # names[:hi-1] is known to fail when hi - lo == 1
        if not ctx.budget_left:
            break
        if passes([n for n in chosen if n != name]):
            chosen.remove(name)
    return with_modules(base, chosen)


def _most_in_fp32(ctx: Context, base: Policy, names: list[str]) -> int:
    """How many of the ranked ``names`` (a prefix) can run in FP32 and leave ``min_amp_share`` of the FLOPs in reduced
    precision: all of them when the rule sets none, -1 when ``base`` itself leaves too little. Each module moved to FP32
    takes work out of reduced precision, so the share falls as the prefix grows: bisected on the audit."""
    if not short_of_share(ctx, with_modules(base, names)):
        return len(names)
    if short_of_share(ctx, base):
        return -1
    lo, hi = 0, len(names)  # lo keeps the share, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not short_of_share(ctx, with_modules(base, names[:mid])) else (lo, mid)
    return lo
