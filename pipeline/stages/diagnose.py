"""Stage diagnose@DTYPE: findings that explain a failing trial (cheap when all is well)."""

from __future__ import annotations

from pipeline import diagnostics, paths
from pipeline.artifacts import read_json, write_json
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    stats = read_json(paths.compare(dtype) / "stats.json", f"compare@{dtype}")
    trajectory = read_json(paths.trial(dtype) / "trajectory.json", f"trial@{dtype}")
    report = diagnostics.triage(stats, trajectory["steps"], params.acceptance)
    write_json(paths.diagnose(dtype) / "diagnosis.json", report)
    print(f"diagnose {dtype}: {len(report['findings'])} finding(s)")
