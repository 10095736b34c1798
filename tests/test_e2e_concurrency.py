"""Issue 15 for real: a parallel DVC queue against one new MLflow database, and a fresh clone that publishes.

Both run real `dvc` in temporary git repositories (tiny params, seconds per stage).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from _project import BIN, dvc, run

pytestmark = pytest.mark.integration


def parents(db: Path) -> list:
    import mlflow

    c = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = c.get_experiment_by_name("amp-validation")
    runs = [] if exp is None else c.search_runs([exp.experiment_id], max_results=1000)
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def experiment_names(repo: Path) -> set[str]:
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    return {e.get("name") for c in shown for e in (c.get("experiments") or []) if e.get("name")}


def wait_for_queue(repo: Path, env: dict, limit: float = 900) -> str:
    """Poll `dvc queue status` until nothing is queued or running; stop the queue's workers in any case."""
    deadline = time.monotonic() + limit
    try:
        while True:
            status = run([str(BIN / "dvc"), "queue", "status"], repo, env=env).stdout
            if not any(word in status for word in ("Queued", "Running")):
                return status
            assert time.monotonic() < deadline, status
            time.sleep(10)  # each `dvc queue status` is a dvc start-up (~2 s of CPU), taken from the queue's workers
    finally:
        run([str(BIN / "dvc"), "queue", "stop"], repo, env=env, check=False)


# The queue's race on a new database: tests/test_e2e_readme.py::test_sweep_block_runs_as_written (two workers, no mlflow.db).


def test_a_fresh_clone_publishes_what_it_reproduces_and_a_rerun_adds_nothing(reproduced, tmp_path):
    """A clone whose outputs match the committed dvc.lock (they come from a shared DVC cache): `dvc repro`
    finds every stage unchanged, yet publish runs, because this tracking store lacks the execution."""
    origin = tmp_path / "origin"
    subprocess.run(["cp", "-a", str(reproduced), str(origin)], check=True)
    run(["git", "add", "-A"], origin)
    run(["git", "commit", "-qm", "reproduced"], origin)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(origin), str(clone)], tmp_path)
    dvc(clone, "cache", "dir", str(origin / ".dvc" / "cache"))  # a team's shared cache: nothing recomputed
    dvc(clone, "checkout")
    assert not (clone / "mlflow.db").exists()
    first = dvc(clone, "repro")
    assert "Running stage 'publish'" in first.stdout, first.stdout
    assert not [
        line for line in first.stdout.splitlines() if line.startswith("Running stage") and "publish" not in line
    ], first.stdout
    runs = parents(clone / "mlflow.db")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    start = time.monotonic()
    again = dvc(clone, "repro")
    took = time.monotonic() - start
    assert "already published, nothing added" in again.stdout, again.stdout
    assert len(parents(clone / "mlflow.db")) == 1
    print(f"\nno-op publish inside `dvc repro`: {took:.1f} s")
