"""Stage decide@NAME: apply the frozen rule; on rollback, package what restores the reference.

The decision is a function of this stage's DVC deps alone: no MLflow, no clock, no torch. Whether a rule
was loosened after an earlier rollback is history, read from versioned sources by publish, not here.
"""

from __future__ import annotations

import dataclasses
import functools

from pipeline import paths, rule
from pipeline.artifacts import audit, comparison, decision, diagnosis, reference, rollback, trial
from pipeline.config import load_params
from pipeline.present import verdict


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    ref = reference.read_manifest()
    ref.check_rule(params.acceptance)
    found = diagnosis.read(variant)
    ran = trial.read_manifest(variant)
    recorded = dict(rule=dataclasses.asdict(params.acceptance), rule_sha256=params.acceptance.sha256(), policy=ran.policy,
                    env=ran.env)
    package = str(rollback.folder(variant))
    if (failed := trial.read_failure(variant, ran)) is not None:  # it raised under its policy: no statistics to judge
        stats, engaged = None, None
        result = decision.of_failure(variant, failed, findings=found.findings, notes=ran.env_notes(ref.env),
                                     rollback_package=package, **recorded)
    else:
        stats = comparison.read(variant)
        engaged = audit.read(paths.trial(variant), trial.produced_by(variant), ran.files[paths.TRIAL_AUDIT])
        judged = rule.decide(stats, params.acceptance, engaged)  # its numerics, and whether AMP engaged at all
        result = decision.Decision(
            variant=variant,
            decision=judged.decision,
            reasons=list(judged.reasons),
            checks=list(judged.checks),
            inference=judged.inference,
            training=judged.training,
            cases={k: list(v) for k, v in judged.cases.items()},
            findings=found.findings if not judged.accepted else [],  # where the rollback starts and what would fix it
            notes=ran.env_notes(ref.env) + ([engaged.line] if engaged.flagged else []),  # a speedup claim it cannot back
            rollback_package=None if judged.accepted else package,
            **recorded,
        )
    packer = None if result.accepted else functools.partial(rollback.write_package, params, ref, stats, variant, result.cases)
    decision.write(result, packer)  # the package in the decision's folder, replaced with it
    decision.write_metrics(result, stats)
    # the verdict block, as everywhere
    print(verdict.text(verdict.verdict(variant, result, stats, found, audit=engaged)))
