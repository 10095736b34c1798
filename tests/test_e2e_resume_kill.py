"""Kill the trial with SIGKILL at several points; the rerun resumes and ends byte-identical (CPU)."""

from __future__ import annotations

import hashlib
import shutil
import signal

import pytest

import faults
from _project import env_for, run

import sys

pytestmark = pytest.mark.integration

FILES = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")


def digests(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


# TINY trains 12 steps with a resumable state every 4: kill between two saves, right after a save, and
# after the last step (before any output is written).
@pytest.mark.parametrize("kill_after", [2, 6, 8, 12])
def test_killed_trial_resumes_to_identical_outputs(reproduced, tmp_path, kill_after):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    trial = repo / "data/trial/float16"
    expected = digests(trial)
    shutil.rmtree(trial)  # as DVC does before running a stage

    env = faults.after_step(env_for(repo), kill_after)
    killed = run([sys.executable, "-m", "pipeline", "trial", "--variant", "float16"], repo, check=False, env=env)
    assert killed.returncode == -signal.SIGKILL
    assert not (trial / "checkpoint.safetensors").exists()  # nothing half-written
    resume = repo / "data/resume/trial-float16.safetensors"
    assert resume.exists() == (kill_after >= 4)

    done = run([sys.executable, "-m", "pipeline", "trial", "--variant", "float16"], repo)
    assert done.returncode == 0
    assert "restarts from step 0" not in done.stderr, done.stderr  # it resumed: the killed run saved under the rerun's key
    assert digests(trial) == expected
    assert not resume.exists()  # cleared once the outputs are written


def test_a_resume_state_from_another_run_is_ignored(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    trial = repo / "data/trial/float16"
    expected = digests(trial)
    env = faults.after_step(env_for(repo), 6)
    run([sys.executable, "-m", "pipeline", "trial", "--variant", "bfloat16"], repo, check=False, env=env)
    # A bfloat16 state renamed to look like the float16 one: its run key differs, so it is not used.
    shutil.copy(repo / "data/resume/trial-bfloat16.safetensors", repo / "data/resume/trial-float16.safetensors")
    run([sys.executable, "-m", "pipeline", "trial", "--variant", "float16"], repo)
    assert digests(trial) == expected
