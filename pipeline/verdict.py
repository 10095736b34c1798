"""The acceptance rule applied to comparison statistics: accept, or roll back, with every reason.

Pure: statistics (the dict that compare writes) and the rule in, a decision out. Every failed criterion
is a reason; a variant is accepted only when there is none. Passing criteria are listed as checks so a
reviewer sees what was verified, not only what failed.

What each criterion needs from the outputs (for very large vocabularies, where storing [N, T, C] scores
of both sides may be too much, this is what a reduced store would have to keep):
- ``outputs.*`` tolerances and ``max_failing_fraction``: every output element of both sides;
- ``max_flips``, ``max_near_boundary_flips``, ``max_boundary_flip_fraction``, ``min_top1_agreement``:
  per case / token, each side's argmax and the reference's top-2 scores (``boundary_margin_kind:
  probability`` also needs the reference's log-sum-exp; ``relative`` the spread of its scores);
- ``max_kl_mean``, ``max_kl_p99``: both full distributions per token (top-k logits plus log-sum-exp
  give only a bound: the probability mass outside the top k is known, its shape is not);
- ``min_quality``, ``max_quality_drop``: the primary output on the cases with a target (accuracy and
  top-k need the argmax / top-k indices; perplexity the log-sum-exp and the target's logit);
- training criteria: the per-step trajectories only (and the FP32 replicate's for the noise floor).
"""

from __future__ import annotations

import math

from pipeline.config import AcceptanceConfig


def decide(stats: dict, rule: AcceptanceConfig, findings: list[str] | None = None) -> dict:
    """Apply ``rule`` to ``stats``; ``findings`` (diagnosis) are attached to the reasons on rollback."""
    reasons: list[str] = []
    checks: list[str] = []

    def check(ok: bool, passed: str, failed: str) -> None:
        (checks if ok else reasons).append(passed if ok else failed)

    for name, gap in sorted(stats["values"].items()):
        nonfinite = gap["nonfinite_trial_only"]
        check(
            nonfinite == 0,
            f"outputs '{name}': all finite",
            f"outputs '{name}': {nonfinite} non-finite element(s) where the reference is finite",
        )
        check(
            gap["failing_fraction"] <= rule.max_failing_fraction,
            f"values '{name}': {gap['failing']} of {gap['elements']} elements outside atol={gap['atol']} rtol={gap['rtol']} "
            f"(allowed fraction {rule.max_failing_fraction})",
            f"values '{name}': {gap['failing']} of {gap['elements']} elements outside atol={gap['atol']} rtol={gap['rtol']}, "
            f"fraction {gap['failing_fraction']:.4g} > allowed {rule.max_failing_fraction} "
            f"(max abs error {gap['max_abs']:.4g}; would have needed atol >= {gap['min_passing_atol']:.4g})",
        )
    flips = stats["flips"]
    unit = "token" if flips.get("unit") == "token" else "case"
    listed_real = ", ".join(f["id"] + (f"@{f['position']}" if "position" in f else "") for f in flips["flip_list"] if not f["boundary"])[:400]
    check(
        flips["flips"] <= rule.max_flips,
        f"decisions: {flips['flips']} flip(s) among real {unit}s away from the boundary (allowed {rule.max_flips})",
        f"decisions: {flips['flips']} flip(s) among real {unit}s away from the boundary > allowed {rule.max_flips}: {listed_real}",
    )
    near, near_cases = flips.get("near_boundary_flips", 0), flips.get("near_boundary_cases", 0)
    near_ids = ", ".join(f["id"] + (f"@{f['position']}" if "position" in f else "") for f in flips["flip_list"] if f.get("near_boundary"))[:400]
    margin = f"{flips.get('margin_kind', 'logit')} margin < {rule.boundary_margin:g}"
    if rule.max_near_boundary_flips is None:
        # Not limited, but never silent: the count and the ids are in the checks.
        checks.append(f"decisions: {near} flip(s) among {near_cases} real {unit}s near the boundary ({margin}; not limited)"
                      + (f": {near_ids}" if near else ""))
    else:
        check(
            near <= rule.max_near_boundary_flips,
            f"decisions: {near} flip(s) among {near_cases} real {unit}s near the boundary ({margin}; allowed {rule.max_near_boundary_flips})"
            + (f": {near_ids}" if near else ""),
            f"decisions: {near} flip(s) among {near_cases} real {unit}s near the boundary ({margin}) > allowed "
            f"{rule.max_near_boundary_flips}: {near_ids}",
        )
    check(
        flips["boundary_flip_fraction"] <= rule.max_boundary_flip_fraction,
        f"decisions: {flips['boundary_flips']} of {flips['boundary_cases']} boundary cases flipped "
        f"(allowed fraction {rule.max_boundary_flip_fraction})",
        f"decisions: {flips['boundary_flips']} of {flips['boundary_cases']} boundary cases flipped, "
        f"fraction {flips['boundary_flip_fraction']:.3g} > allowed {rule.max_boundary_flip_fraction}",
    )
    _distribution(stats.get("distribution"), rule, check, reasons)
    for label, key_ref, key_trial in (
        ("inference", "reference", "trial"),
        ("after training", "reference", "trained"),
    ):
        ref_q, trial_q = stats["quality"][key_ref], stats["quality"][key_trial]
        if not math.isfinite(ref_q):  # no ordinary case or token carries a target: nothing to measure on
            checks.append(f"quality {label}: the fixed set has no target to measure it on; not applied")
            continue
        if not math.isfinite(trial_q):
            reasons.append(f"quality {label}: not finite")
            continue
        drop = ref_q - trial_q if stats["quality"].get("higher_is_better", True) else trial_q - ref_q
        check(
            drop <= rule.max_quality_drop,
            f"quality {label}: {trial_q:.4f} vs reference {ref_q:.4f} (drop {drop:.4f} <= {rule.max_quality_drop})",
            f"quality {label}: {trial_q:.4f} vs reference {ref_q:.4f}, drop {drop:.4f} > allowed {rule.max_quality_drop}",
        )
        if rule.min_quality is not None and stats["quality"].get("higher_is_better", True):
            check(
                trial_q >= rule.min_quality,
                f"quality {label}: {trial_q:.4f} >= minimum {rule.min_quality}",
                f"quality {label}: {trial_q:.4f} below minimum {rule.min_quality}",
            )
        elif rule.min_quality is not None:  # a smaller-is-better metric: the bound is its worst acceptable value
            check(
                trial_q <= rule.min_quality,
                f"quality {label}: {trial_q:.4f} <= worst acceptable {rule.min_quality}",
                f"quality {label}: {trial_q:.4f} worse than the worst acceptable {rule.min_quality}",
            )
    train = stats["training"]
    check(
        train["first_nonfinite_loss_step"] < 0,
        "training: every loss finite",
        f"training: loss not finite from step {train['first_nonfinite_loss_step']}",
    )
    check(
        train["band_violations"] == 0,
        f"training: loss within band at every step (max gap {train['max_loss_gap']:.4g} at step {train['max_loss_gap_step']})",
        f"training: loss outside band (atol={rule.loss_atol}, rtol={rule.loss_rtol}) at {train['band_violations']} of "
        f"{train['steps']} steps, first at step {train['first_violation_step']}",
    )
    _noise_floor(train.get("noise"), rule, check, reasons)
    check(
        train["skipped_fraction"] <= rule.max_skipped_fraction,
        f"training: {train['skipped_steps']} skipped update(s) of {train['steps']} (allowed fraction {rule.max_skipped_fraction})",
        f"training: {train['skipped_steps']} of {train['steps']} updates skipped, fraction "
        f"{train['skipped_fraction']:.3g} > allowed {rule.max_skipped_fraction}",
    )
    check(
        not train["stalled"],
        f"training: real updates still advancing in the last {rule.stall_window} steps",
        f"training: updates stopped advancing: no real update in the last {rule.stall_window} steps",
    )
    if train.get("scaler_enabled", True):  # without a GradScaler (bfloat16) there is no scale to fall
        check(
            train["final_scale"] >= rule.min_scale,
            f"training: final loss scale {train['final_scale']:g} >= {rule.min_scale:g}",
            f"training: updates stopped advancing: loss scale fell to {train['final_scale']:g} < {rule.min_scale:g}",
        )
    if reasons and findings:
        reasons.extend(f"diagnosis: {f}" for f in findings)
    return {"decision": "rollback" if reasons else "accept", "reasons": reasons, "checks": checks}


def _distribution(dist: dict | None, rule: AcceptanceConfig, check, reasons: list[str]) -> None:
    """KL and top-1 agreement of per-token outputs, each applied when the rule sets it."""
    wanted = [rule.max_kl_mean, rule.max_kl_p99, rule.min_top1_agreement]
    if all(w is None for w in wanted):
        return
    if dist is None:
        reasons.append("distribution: the rule sets max_kl_mean / max_kl_p99 / min_top1_agreement but the outputs are not "
                       "per-token scores [N, T, C]; remove those criteria or compare per-token outputs")
        return
    for key, limit, label in (("kl_mean", rule.max_kl_mean, "mean"), ("kl_p99", rule.max_kl_p99, "p99")):
        if limit is not None:
            value = dist[key]
            check(
                value <= limit,
                f"distribution: KL(reference || trial) {label} {value:.4g} nats over {dist['tokens']} tokens <= {limit:g}",
                f"distribution: KL(reference || trial) {label} {value:.4g} nats > allowed {limit:g} (max {dist['kl_max']:.4g})",
            )
    if rule.min_top1_agreement is not None:
        value = dist["top1_agreement"]
        check(
            value >= rule.min_top1_agreement,
            f"distribution: top-1 agreement {value:.6f} >= {rule.min_top1_agreement:g}",
            f"distribution: top-1 agreement {value:.6f} below minimum {rule.min_top1_agreement:g}",
        )


def _noise_floor(noise: dict | None, rule: AcceptanceConfig, check, reasons: list[str]) -> None:
    """AMP's per-step loss gap bounded by a multiple of FP32's own noise (the replicate's gap), when set."""
    if rule.loss_noise_multiple is None and rule.loss_noise_atol is None:
        return
    if noise is None:
        reasons.append("training: the rule bounds the loss gap by the noise floor (loss_noise_multiple / loss_noise_atol) but "
                       "the reference has no replicate trajectory; set reference.noise_replicate: true and re-freeze")
        return
    band = f"{rule.loss_noise_multiple or 0:g} x replicate gap + {rule.loss_noise_atol or 0:g}"
    check(
        noise["violations"] == 0,
        f"training: loss gap within the noise floor ({band}) at every step (mean AMP gap {noise['mean_amp_gap']:.4g}, "
        f"mean FP32 replicate gap {noise['mean_replicate_gap']:.4g})",
        f"training: loss gap above the noise floor ({band}) at {noise['violations']} step(s), first at step "
        f"{noise['first_violation_step']} (mean AMP gap {noise['mean_amp_gap']:.4g} vs FP32 replicate {noise['mean_replicate_gap']:.4g})",
    )


# Direction in which each numeric criterion of the rule gets looser: +1 when a larger value lets more
# through. For a criterion that may be null, null means "not applied", the loosest of all.
# tests/test_verdict.py ties this table to AcceptanceConfig: a new field cannot be forgotten here.
_LOOSER_WHEN = {
    "max_failing_fraction": +1,
    "boundary_margin": +1,  # more real cases count as near the boundary, whose flips may be limited less
    "max_flips": +1,
    "max_near_boundary_flips": +1,
    "max_boundary_flip_fraction": +1,
    "max_kl_mean": +1,
    "max_kl_p99": +1,
    "min_top1_agreement": -1,
    "min_quality": -1,
    "max_quality_drop": +1,
    "loss_rtol": +1,
    "loss_atol": +1,
    "loss_noise_multiple": +1,
    "loss_noise_atol": +1,
    "max_skipped_fraction": +1,
    "stall_window": +1,
    "min_scale": -1,
}
# Criteria that are not a number on a line, compared by ``loosened`` one by one.
_COMPARED_APART = ("outputs", "tie_rule", "threshold", "boundary_margin_kind")


def loosened(old: dict, new: dict) -> list[str]:
    """Criteria on which rule ``new`` lets through more than rule ``old`` (both as plain dicts).

    Any loosened criterion is listed, even if others were tightened: a tolerance widened to make a
    case disappear must be visible whatever else changed.
    """
    out = []
    names = sorted(set(old["outputs"]) | set(new["outputs"]))
    for name in names:
        o = old["outputs"].get(name, old["outputs"].get("*", {}))
        n = new["outputs"].get(name, new["outputs"].get("*", {}))
        for key in ("atol", "rtol"):
            if key in o and key in n and n[key] > o[key]:
                out.append(f"outputs.{name}.{key} {o[key]:g} -> {n[key]:g}")
    for key, sign in _LOOSER_WHEN.items():
        a, b = old.get(key), new.get(key)
        if a is None and b is None:
            continue
        if a is not None and b is None:
            out.append(f"{key} removed (was {a:g})")
            continue
        if a is None:
            continue
        if (b - a) * sign > 0:
            out.append(f"{key} {a:g} -> {b:g}")
    if old.get("tie_rule") == "tie_is_flip" and new.get("tie_rule") == "lowest_index":
        out.append("tie_rule tie_is_flip -> lowest_index")
    if old.get("threshold") is not None and new.get("threshold") is None:
        out.append("threshold removed")
    if old.get("boundary_margin_kind", "logit") != new.get("boundary_margin_kind", "logit"):
        # Another unit: not comparable, so listed (a margin in logits of 0.05 may be 0.3 in probability).
        out.append(f"boundary_margin_kind {old.get('boundary_margin_kind', 'logit')} -> {new.get('boundary_margin_kind', 'logit')}")
    return out


def flag_loosened_rule(decision: dict, rule: dict, earlier_rollbacks: list[dict]) -> dict:
    """On an accept, say so when an earlier rollback of the same reference ran under a stricter rule."""
    if decision["decision"] != "accept":
        return decision
    for earlier in earlier_rollbacks:
        diff = loosened(earlier["rule"], rule)
        if diff:
            decision["reasons"].append(
                f"warning: accepted under a rule looser than the one (sha256 {earlier['rule_sha256'][:12]}) under which this "
                f"reference was rolled back before: {'; '.join(diff)}"
            )
            decision.setdefault("tags", {})["rule_loosened"] = "true"
    return decision
