"""Stage diagnose@NAME: why a trial failed and which FP32 regions would fix it (cheap when all is well).

Writes ``diagnosis.json`` (findings and notes as lines, the structured details beside them, and for a float16
variant freeze's FP16 forecast checked against the trial) and, when there is one, ``suggested_params.yaml``: a
suggestion, never applied. A healthy trial costs a few JSON reads: torch and the task's model load only when there
is something to replay or probe. A failed trial (it raised under its policy) was located by the trial itself: its
diagnosis is that failure, with nothing replayed.
"""

from __future__ import annotations

import dataclasses
import time

from pipeline import rule
from pipeline.artifacts import comparison, diagnosis, trial
from pipeline.config import Policy, load_params
from pipeline.diagnosis import triage


def main(variant: str, params_path: str = "params.yaml") -> None:
    start = time.perf_counter()
    params = load_params(params_path)
    ran = trial.read_manifest(variant)
    if (failed := trial.read_failure(variant, ran)) is not None:
        diagnosis.write(variant, diagnosis.of_failure(failed))
        print(f"diagnose {variant}: the trial failed under its policy, located by its replay:\n  - {failed.line(variant)}")
        return
    stats = comparison.read(variant)
    trajectory = trial.read_trajectory(variant, ran)
    judged = rule.decide(stats, params.acceptance)  # once; the diagnosis is handed it
    found, suggested = diagnosis.Diagnosis(), None
    if judged.reasons or params.diagnose.probe == "always":
        from pipeline.diagnosis import flow, wording

        found = flow.run(params, variant, stats, trajectory, judged)
        suggested = wording.snippet(found.suggestion, variant, params.trial.policy(variant)) if found.suggestion else None
    found = dataclasses.replace(found, forecast=triage.forecast_check(Policy.from_dict(ran.policy), stats, trajectory.steps))
    diagnosis.write(variant, found, suggested)
    work = found.work
    print(
        f"diagnose {variant}: {len(found.findings)} finding(s), {work.trial_reruns} trial re-run(s), "
        f"{work.replayed_steps} replayed step(s), {time.perf_counter() - start:.1f}s"
        + "".join(f"\n  - {f}" for f in found.findings + found.notes)
        + (f"\n  {found.forecast.line}" if found.forecast else "")
    )

