"""Stage decide@DTYPE: apply the frozen rule; on rollback, package what restores the reference.

The decision is a function of this stage's DVC deps alone: no MLflow, no clock, no torch. Whether a rule
was loosened after an earlier rollback is history, read from versioned sources by publish, not here.
"""

from __future__ import annotations

import dataclasses

from pipeline import paths

from pipeline.present import verdict

from pipeline import rule

from pipeline.artifacts import rollback

from pipeline.artifacts import decision

from pipeline.artifacts import comparison
from pipeline.files import read_json
from pipeline.config import load_params
from pipeline.errors import UserError


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    # The manifests as JSON: pipeline.artifacts.reference and pipeline.artifacts.trial import torch, which this stage never needs.
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    rule_sha = params.acceptance.sha256()
    if manifest.get("rule_sha256") != rule_sha:  # reference.load's words: one message wherever it is caught
        raise UserError(
            f"the acceptance rule in params.yaml (sha256 {rule_sha[:12]}…) differs from the one frozen with the reference "
            f"({str(manifest.get('rule_sha256'))[:12]}…); the rule is fixed before the trial: run `dvc repro` to re-freeze under the new rule"
        )
    stats = comparison.read(dtype)
    diagnosis = read_json(paths.diagnose(dtype) / "diagnosis.json", f"diagnose@{dtype}")
    trial_manifest = read_json(paths.trial(dtype) / "manifest.json", f"trial@{dtype}")
    verdict_ = rule.decide(stats.raw, params.acceptance, diagnosis["findings"])
    result = decision.Decision(
        dtype=dtype,
        decision=verdict_["decision"],
        reasons=verdict_["reasons"],
        checks=verdict_["checks"],
        inference=verdict_["inference"],
        training=verdict_["training"],
        cases=verdict_["cases"],
        rule=dataclasses.asdict(params.acceptance),
        rule_sha256=rule_sha,
        policy=trial_manifest["policy"],
        env=trial_manifest["env"],
    )
    differs = trial_manifest["env_differs_from_reference"]
    if differs:  # floating-point results differ across devices and execution paths: say so, beside the verdict
        result.notes.append(f"the trial ran with a different {', '.join(differs)} than the reference: {manifest['env']} vs {trial_manifest['env']}")
    if not result.accepted:
        result.rollback_package = str(paths.decision(dtype) / "rollback")
        rollback.write_package(paths.decision(dtype) / "rollback", params, manifest, stats, dtype, result.cases)
    decision.write(result)
    decision.write_metrics(result, stats)
    print(verdict.text(verdict.verdict(dtype, result.as_dict(), stats.raw, diagnosis)))  # the verdict block, as everywhere
