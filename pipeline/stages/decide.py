"""Stage decide@DTYPE: apply the frozen rule; on rollback, package what restores the reference."""

from __future__ import annotations

import dataclasses

from pipeline import paths, rollback, tracking, verdict
from pipeline.artifacts import read_json, write_json
from pipeline.config import load_params
from pipeline.errors import UserError


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    rule_sha = params.acceptance.sha256()
    if manifest["rule_sha256"] != rule_sha:
        raise UserError(
            "the acceptance rule in params.yaml differs from the one frozen with the reference; a rule is fixed "
            "before the trial: run `dvc repro` so the reference is re-frozen and every trial re-run under it"
        )
    stats = read_json(paths.compare(dtype) / "stats.json", f"compare@{dtype}")
    diagnosis = read_json(paths.diagnose(dtype) / "diagnosis.json", f"diagnose@{dtype}")
    trial_manifest = read_json(paths.trial(dtype) / "manifest.json", f"trial@{dtype}")
    result = verdict.decide(stats, params.acceptance, diagnosis["findings"])
    rule = dataclasses.asdict(params.acceptance)
    result.update({"dtype": dtype, "rule": rule, "rule_sha256": rule_sha, "policy": trial_manifest["policy"], "env": trial_manifest["env"]})
    # A tolerance widened to make a case disappear must be visible: compare with earlier rollbacks of this reference.
    earlier, unread = tracking.earlier_rollbacks(params.tracking.experiment, manifest["run_key"], dtype)
    verdict.flag_loosened_rule(result, rule, earlier)
    differs = trial_manifest["env_differs_from_reference"]
    if differs:
        # Floating-point results differ across devices and execution paths: say so, beside the verdict.
        result.setdefault("notes", []).append(f"the trial ran with a different {', '.join(differs)} than the reference: {manifest['env']} vs {trial_manifest['env']}")
    if unread:
        result.setdefault("notes", []).append(f"earlier decisions could not be read, so a loosened rule would go unflagged: {unread}")
    out = paths.decision(dtype)
    if result["decision"] == "rollback":
        result["rollback_package"] = str(out / "rollback")
        rollback.write_package(out / "rollback", params, manifest, stats, dtype)
    write_json(out / "decision.json", result)
    write_json(paths.decision_metrics(dtype), {
        "accepted": int(result["decision"] == "accept"),
        "reasons": len(result["reasons"]),
        "rule_loosened": int("rule_loosened" in result.get("tags", {})),
    })
    print(f"decide {dtype}: {result['decision'].upper()}" + "".join(f"\n  - {r}" for r in result["reasons"]))
