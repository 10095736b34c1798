"""Stage publish: mirror every stage's results to MLflow, once (the DVC outputs stay the source of truth).

One parent run per pipeline execution, one child per variant (``pipeline.present.runs``). Its key
(``provenance.publish_key``) hashes the reference, the git commit, the params and the bytes of every mirrored
file, so publishing the same results again adds nothing while a rerun that changed anything (a
`dvc exp run`, new benchmark timings) gets a run of its own.

The stage is ``always_changed`` in dvc.yaml: a fresh clone whose outputs match dvc.lock still publishes,
and publishing what the store already holds is a no-op that says so, answered from the project's own
record without importing MLflow (``tracking.published``). Whether the rule was loosened after an earlier
rollback of the same reference is read here, from the runs published before, and is said in the verdict
and tagged: the decision itself never depends on MLflow.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from pipeline import paths, provenance, tracking
from pipeline.artifacts import reference, variant
from pipeline.config import load_params
from pipeline.files import flatten
from pipeline.present import runs, verdict


def main(params_path: str = "params.yaml") -> None:
    started = time.monotonic()
    params = load_params(params_path)
    names = params.trial.variants
    manifest = reference.read_manifest()
    flat = flatten(asdict(params))
    commit = provenance.git_commit()
    key = provenance.publish_key(manifest.run_key, manifest.rule_sha256, commit, flat, names)
    variants = {d: variant.load(d) for d in names}

    already = tracking.published(tracking.tracking_uri(), params.tracking.experiment, key)
    if already is not None:  # the common no-op of `dvc repro`: answered without importing MLflow
        print(f"publish: already published, nothing added; parent run {already.run_link}")
        print(f"publish: {verdict.one_line(runs.verdicts(variants, {}))}; review: {already.link}")
        return
    # Not before the lookup: a key that matches holds these very params, checked when they were published.
    provenance.check_fresh(params_path, names)

    common = runs.common_tags(commit, manifest, provenance.dvc_experiment_name())
    publisher = tracking.Publisher(params.tracking.experiment)
    loosened = {d: runs.loosened(v.decision, publisher.earlier_rollbacks(manifest.run_key, d)) for d, v in variants.items()}
    verdicts = runs.verdicts(variants, loosened)
    ref_steps, replicate = reference.read_trajectory(manifest), reference.read_replicate(manifest)
    parent = runs.parent(manifest, variants, verdicts, ref_steps, common, flat, params_path)
    children = [runs.child(variants[v.variant], v, loosened[v.variant], ref_steps, replicate, common, flat) for v in verdicts]
    for v, child in zip(verdicts, children):  # GPU samples of its trial and benchmark (none on the CPU)
        child.system_metrics = [paths.system_metrics(stage, v.variant) for stage in ("trial", "benchmark")]
    # A loosened rule is said at every publish: such a tree is not recorded for the no-op above.
    result = publisher.publish(key, parent, children, remember=not any(loosened.values()))
    for w in (w for v in verdicts for w in v.warnings):
        print(f"publish: warning: {w}")
    if result.removed:
        print(f"publish: removed {result.removed} duplicate or orphaned run(s) left by concurrent or interrupted publishes")
    done = (
        f"{result.created} run(s) created in {time.monotonic() - started:.1f} s" if result.created
        else "already published, nothing added"
    )
    print(f"publish: {done}; parent run {result.run_link}")
    print(f"publish: {verdict.one_line(verdicts)}; review: {result.link}")
