"""Resume state is never trusted blindly (issue 24, items 1 and 2), in a real stage process.

Each test stops a real stage process at a known step (``faults.after_step(..., stop=True)``: the process freezes
itself with SIGSTOP), SIGKILLs it from outside, changes something between the runs, and checks that the rerun is
byte-identical to an uninterrupted run of the new configuration. The unit tests of the resume files themselves
(damage, scaler state, the run key) are tests/test_checkpoint.py's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
from _project import env_for, run, write_params

FILES = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")


# --- integration: a real stage process, stopped at a known step, SIGKILLed from outside ----------------------


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


def kill_at(args: list[str], repo: Path, step: int, env: dict | None = None) -> None:
    """Run a stage until it stops itself after ``step`` (SIGSTOP), then SIGKILL it: a real kill, from outside."""
    env = faults.after_step(env or env_for(repo), step, stop=True)
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stat = Path(f"/proc/{proc.pid}/stat")
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":  # stopped
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the stage ended before step {step}: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


TRIAL = [sys.executable, "-m", "pipeline", "trial", "--variant", "float16"]


@pytest.fixture
def killed_trial(reproduced, tmp_path):
    """A copy of the reproduced project whose float16 trial was SIGKILLed after step 6 (state saved at step 4)."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    trial = repo / "data/trial/float16"
    expected = digests(trial)
    shutil.rmtree(trial)  # as DVC does before running a stage
    kill_at(TRIAL, repo, 6)
    assert (repo / "data/resume/trial-float16.safetensors").exists()
    return repo, expected


def test_a_flipped_bit_in_the_resume_state_costs_a_restart_not_a_wrong_result(killed_trial):
    repo, expected = killed_trial
    resume = repo / "data/resume/trial-float16.safetensors"
    faults.flip_exponent_bit(resume)
    done = run(TRIAL, repo)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "sha256" in warnings[0] and "restarts from step 0" in warnings[0], done.stderr
    assert digests(repo / "data/trial/float16") == expected
    assert not resume.exists() and not resume.with_name(resume.name + ".sha256").exists()


def assert_as_uninterrupted(repo):
    """The trial the rerun after the kill wrote is the one an uninterrupted run of the same code and params writes."""
    after_kill = digests(repo / "data/trial/float16")
    shutil.rmtree(repo / "data/trial/float16")
    run(TRIAL, repo)
    assert digests(repo / "data/trial/float16") == after_kill


def test_a_model_code_change_after_a_kill_restarts_and_matches_a_clean_run(killed_trial):
    repo, _ = killed_trial
    digits = repo / "pipeline/examples/digits.py"
    digits.write_text(digits.read_text().replace("torch.nn.ReLU()", "torch.nn.Tanh()"))
    resumed = run(TRIAL, repo)
    assert "was saved by another run (" in resumed.stderr and "code differ)" in resumed.stderr, resumed.stderr
    assert_as_uninterrupted(repo)


def test_a_recipe_edit_after_a_kill_restarts_and_matches_a_clean_run(killed_trial):
    """params' recipe edited after the kill (reference.lr), the trial run alone (the reference is not refrozen): the
    state trained at the old lr is another run's (restoring its optimizer would even bring the old lr back), so the
    trial restarts and ends as an uninterrupted run at the new lr does."""
    repo, _ = killed_trial
    write_params(repo, {"reference": {"lr": 0.2}})
    resumed = run(TRIAL, repo)
    assert "was saved by another run" in resumed.stderr, resumed.stderr
    assert_as_uninterrupted(repo)


def test_a_thread_count_change_after_a_kill_restarts_and_matches_a_clean_run(killed_trial):
    repo, _ = killed_trial
    write_params(repo, {"threads": 2})
    resumed = run(TRIAL, repo)
    assert "threads 1 -> 2" in resumed.stderr, resumed.stderr
    assert_as_uninterrupted(repo)
