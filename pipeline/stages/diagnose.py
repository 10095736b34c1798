"""Stage diagnose@DTYPE: why a trial failed and which FP32 regions would fix it (cheap when all is well).

Writes ``diagnosis.json`` (findings and notes as lines, the structured details beside them) and, when
there is one, ``suggested_params.yaml``: a suggestion, never applied. A healthy trial costs two JSON reads:
torch and the task's model load only when there is something to replay or probe.
"""

from __future__ import annotations

import time

from pipeline import paths

from pipeline import rule

from pipeline.artifacts import comparison
from pipeline.files import read_json, write_bytes, write_json
from pipeline.config import load_params

NOTHING_TO_DO = {
    "needed": False,
    "failing": [],
    "findings": [],
    "notes": [],
    "work": {"replayed_steps": 0, "traced_passes": 0, "trial_reruns": 0},
}


def main(dtype: str, params_path: str = "params.yaml") -> None:
    start = time.perf_counter()
    params = load_params(params_path)
    stats = comparison.read(dtype).raw
    trajectory = read_json(paths.trial(dtype) / "trajectory.json", f"trial@{dtype}")  # as JSON: pipeline.artifacts.trial imports torch
    decision = rule.decide(stats, params.acceptance)  # once; the diagnosis is handed it
    out = paths.diagnose(dtype)
    report = NOTHING_TO_DO
    if decision["reasons"] or params.diagnose.probe == "always":
        from pipeline.diagnosis import flow, wording

        report = flow.run(params, dtype, stats, trajectory, decision)
        if report["suggestion"]:
            write_bytes(out / "suggested_params.yaml", wording.snippet(report, dtype).encode())
    write_json(out / "diagnosis.json", report)
    work = report["work"]
    print(
        f"diagnose {dtype}: {len(report['findings'])} finding(s), {work['trial_reruns']} trial re-run(s), "
        f"{work['replayed_steps']} replayed step(s), {time.perf_counter() - start:.1f}s"
        + "".join(f"\n  - {f}" for f in report["findings"] + report["notes"])
    )
