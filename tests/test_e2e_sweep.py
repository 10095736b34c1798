"""Issue 14 items 3 and 4: sweeps on DVC's own queue, and a reference shared through a DVC remote.

Real `dvc exp run --queue` / `dvc queue start --jobs 2` / `dvc exp show`, and real `dvc push` / `dvc pull`
between two clones through a local-directory remote. Tiny params: the point is which stages run.
"""

from __future__ import annotations

import json

import pytest
from _project import ROOT, dvc, run
from conftest import make_project

pytestmark = pytest.mark.integration

SMALL = {"bench": {"repeats": 1, "steps": 1, "warmup": 0}, "prepare": {"ordinary_cases": 32},
         "reference": {"train_steps": 4, "checkpoint_every": 0, "boundary_cases": 1}, "diagnose": {"search_budget": 0},
         "trial": {"variants": ["bfloat16"]},
         # 4 steps train a reference to accuracy ~0.19: freeze refuses a minimum it cannot meet
         "acceptance": {"min_quality": 0.1}}
# The queued sweep itself is tests/test_e2e_readme.py::test_sweep_block_runs_as_written (the README's block, as written).
RAN_FREEZE = "Running stage 'freeze'"


def test_a_second_clone_pulls_the_reference_and_runs_only_the_trials(tmp_path):
    remote = tmp_path / "remote"
    work = make_project(tmp_path / "workstation", SMALL)
    dvc(work, "remote", "add", "-d", "shared", str(remote))
    dvc(work, "repro", "freeze")
    dvc(work, "push", "prepare", "freeze")
    run(["git", "add", "-A"], work)
    run(["git", "commit", "-qm", "reference"], work)

    ci = tmp_path / "ci"
    run(["git", "clone", "-q", str(work), str(ci)], tmp_path)
    (ci / "mlflow.db").write_bytes((work / "mlflow.db").read_bytes())
    pulled = run(["sh", str(ROOT / "scripts/pull_reference.sh")], ci)  # `dvc pull prepare freeze`, or one line
    assert "error" not in pulled.stderr
    done = dvc(ci, "repro", "trial@bfloat16").stdout
    assert "Running stage 'trial@bfloat16'" in done
    assert RAN_FREEZE not in done and "Running stage 'prepare'" not in done, done[-3000:]
    manifest = json.loads((ci / "data/reference/manifest.json").read_text())
    assert manifest == json.loads((work / "data/reference/manifest.json").read_text())


def test_a_remote_that_does_not_answer_is_one_line_and_exit_2(tmp_path):
    repo = make_project(tmp_path / "repo", SMALL)
    dvc(repo, "remote", "add", "-d", "shared", "http://127.0.0.1:9/store")  # nothing listens on port 9
    pulled = run(["sh", str(ROOT / "scripts/pull_reference.sh")], repo, check=False)
    assert pulled.returncode == 2
    line = pulled.stderr.strip()
    assert line.count("\n") == 0 and "shared" in line, pulled.stderr
    assert not (repo / "data/reference").exists()
