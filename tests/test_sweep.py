"""Issue 14 items 3 and 4: sweeps on DVC's own queue, and a reference shared through a DVC remote.

Real `dvc exp run --queue` / `dvc queue start --jobs 2` / `dvc exp show`, and real `dvc push` / `dvc pull`
between two clones through a local-directory remote. Tiny params: the point is which stages run.
"""

from __future__ import annotations

import json

import pytest
from conftest import BIN, ROOT, dvc, env_for, make_project, run
from test_concurrency import experiment_names, parents, wait_for_queue

pytestmark = pytest.mark.integration

SMALL = {"bench": {"repeats": 1, "steps": 1, "warmup": 0}, "prepare": {"ordinary_cases": 32},
         "reference": {"train_steps": 4, "checkpoint_every": 0, "boundary_cases": 1}, "diagnose": {"search_budget": 0},
         "trial": {"dtypes": ["bfloat16"]}}
RAN_FREEZE = "Running stage 'freeze'"


def test_a_queued_sweep_freezes_the_reference_once_per_distinct_reference(tmp_path):
    repo = make_project(tmp_path / "repo", SMALL)
    dvc(repo, "repro", "freeze")  # the baseline's reference, committed: experiments start from it
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "reference"], repo)
    env = env_for(repo)
    sweep = {  # two workers, two experiments: each dimension of a sweep, at the cost of one
        "f16keep0": ["-S", "trial.dtypes=[float16]", "-S", 'trial.fp32_modules=["0"]'],  # same reference
        "seed1": ["-S", "seed=1"],  # another seed: another reference, frozen in that experiment
    }
    for name, args in sweep.items():
        run([str(BIN / "dvc"), "exp", "run", "--queue", "-n", name, *args], repo, env=env)
    run([str(BIN / "dvc"), "queue", "start", "--jobs", "2"], repo, env=env)
    status = wait_for_queue(repo, env)
    logs = {n: run([str(BIN / "dvc"), "queue", "logs", n], repo, env=env, check=False).stdout for n in sweep}
    assert "Failed" not in status and status.count("Success") >= len(sweep), (status, {n: log[-3000:] for n, log in logs.items()})
    assert set(sweep) <= experiment_names(repo)
    assert RAN_FREEZE not in logs["f16keep0"], logs["f16keep0"][-3000:]
    assert "Running stage 'trial@float16'" in logs["f16keep0"]
    assert RAN_FREEZE in logs["seed1"]
    published = {r.data.tags.get("dvc_experiment") for r in parents(repo / "mlflow.db")}
    assert set(sweep) <= published, published


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
