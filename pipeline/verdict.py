"""The acceptance rule applied to comparison statistics: accept, or roll back, with every reason.

Pure: statistics (the dict that compare writes) and the rule in, a decision out. Every failed criterion
is a reason; a variant is accepted only when there is none. Passing criteria are listed as checks so a
reviewer sees what was verified, not only what failed.
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
    check(
        flips["flips"] <= rule.max_flips,
        f"decisions: {flips['flips']} flip(s) among non-boundary cases (allowed {rule.max_flips})",
        f"decisions: {flips['flips']} flip(s) among non-boundary cases > allowed {rule.max_flips}: "
        + ", ".join(f["id"] for f in flips["flip_list"] if not f["boundary"])[:400],
    )
    check(
        flips["boundary_flip_fraction"] <= rule.max_boundary_flip_fraction,
        f"decisions: {flips['boundary_flips']} of {flips['boundary_cases']} boundary cases flipped "
        f"(allowed fraction {rule.max_boundary_flip_fraction})",
        f"decisions: {flips['boundary_flips']} of {flips['boundary_cases']} boundary cases flipped, "
        f"fraction {flips['boundary_flip_fraction']:.3g} > allowed {rule.max_boundary_flip_fraction}",
    )
    for label, key_ref, key_trial in (
        ("inference", "reference", "trial"),
        ("after training", "reference", "trained"),
    ):
        ref_q, trial_q = stats["quality"][key_ref], stats["quality"][key_trial]
        if not math.isfinite(trial_q):
            reasons.append(f"quality {label}: not finite")
            continue
        drop = ref_q - trial_q
        check(
            drop <= rule.max_quality_drop,
            f"quality {label}: {trial_q:.4f} vs reference {ref_q:.4f} (drop {drop:.4f} <= {rule.max_quality_drop})",
            f"quality {label}: {trial_q:.4f} vs reference {ref_q:.4f}, drop {drop:.4f} > allowed {rule.max_quality_drop}",
        )
        if rule.min_quality is not None:
            check(
                trial_q >= rule.min_quality,
                f"quality {label}: {trial_q:.4f} >= minimum {rule.min_quality}",
                f"quality {label}: {trial_q:.4f} below minimum {rule.min_quality}",
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


# Direction in which each criterion of the rule gets looser: +1 when a larger value lets more through.
_LOOSER_WHEN = {
    "max_failing_fraction": +1,
    "boundary_margin": +1,  # more cases count as boundary cases, whose flips are limited less
    "max_flips": +1,
    "max_boundary_flip_fraction": +1,
    "min_quality": -1,
    "max_quality_drop": +1,
    "loss_rtol": +1,
    "loss_atol": +1,
    "max_skipped_fraction": +1,
    "stall_window": +1,
    "min_scale": -1,
}


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
        if key == "min_quality" and (a is not None and b is None):
            out.append("min_quality removed")
            continue
        if a is None or b is None:
            continue
        if (b - a) * sign > 0:
            out.append(f"{key} {a:g} -> {b:g}")
    if old.get("tie_rule") == "tie_is_flip" and new.get("tie_rule") == "lowest_index":
        out.append("tie_rule tie_is_flip -> lowest_index")
    if old.get("threshold") is not None and new.get("threshold") is None:
        out.append("threshold removed")
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
