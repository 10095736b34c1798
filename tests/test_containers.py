"""The images and workflows, checked statically (no Docker engine and no GPU here): lint and invariants."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT

DOCKERFILES = ("Dockerfile.cuda", "Dockerfile.rocm")
sys.path.insert(0, str(ROOT / "scripts"))
import compare_decisions


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert path, f"{name} not found: install the dev lock (make test does: requirements-dev.lock)"
    return path


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint(dockerfile: str) -> None:
    proc = subprocess.run([tool("hadolint"), dockerfile], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint() -> None:
    proc = subprocess.run([tool("actionlint")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_keeps_its_torch_and_installs_the_lock(dockerfile: str) -> None:
    steps = instructions(dockerfile)
    base = [args for word, args in steps if word == "FROM"]
    assert len(base) == 1 and ":" in base[0] and not base[0].endswith(":latest"), f"{dockerfile}: pin one base image tag"
    if dockerfile.endswith("cuda"):
        assert base[0].startswith("pytorch/pytorch:") and base[0].endswith("-runtime"), base[0]
    else:
        assert base[0].startswith("rocm/pytorch:"), base[0]
    assert ("COPY", "requirements.lock /tmp/requirements.lock") in steps
    runs = " ".join(args for word, args in steps if word == "RUN")
    installs = re.findall(r"pip install ([^&;]*)", runs)
    assert installs, f"{dockerfile}: no pip install"
    for args in installs:
        assert not re.search(r"(^|\s)torch([=<>~!\s]|$)", args), f"{dockerfile} pip-installs torch: {args}"
    # The lock goes in under a constraint made from the image's own torch, and the torch is checked after.
    assert "-c /tmp/keep-torch.txt -r /tmp/requirements.lock" in installs[0]
    assert "'torch==' + torch.__version__" in runs
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile}: run as a non-root user"
    assert ("WORKDIR", "/work") in steps
    assert steps[-1] == ("CMD", '["dvc", "repro"]')


def test_both_images_install_the_same_way() -> None:
    """Only the base image and its comments differ: the same lock, installed the same way."""
    cuda, rocm = (instructions(f)[1:] for f in DOCKERFILES)
    assert cuda == rocm


def test_lock_has_no_torch_and_dockerignore_sends_only_the_lock() -> None:
    names = [
        re.split(r"[=<>\[ ]", line)[0].lower() for line in (ROOT / "requirements.lock").read_text().splitlines() if line.strip()
    ]
    assert "torch" not in names and not any(n.startswith("nvidia-") for n in names)
    lines = [l for l in (ROOT / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert lines == ["*", "!requirements.lock"]


def test_gpu_workflow_shape() -> None:
    flow = yaml.safe_load((ROOT / ".github/workflows/gpu.yml").read_text())
    triggers = flow[True]  # YAML 1.1 reads the key `on` as a boolean
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    job = flow["jobs"]["pipeline"]
    assert job["runs-on"][:4] == ["self-hosted", "linux", "x64", "gpu"]
    assert job["strategy"]["matrix"]["backend"] == ["cuda", "rocm"]
    text = json.dumps(job["steps"])
    for needle in (
        "dvc repro",
        "secrets.MLFLOW_TRACKING_URI",
        "actions/upload-artifact",
        "compare_decisions.py --base-ref origin/main",
    ):
        assert needle in text, needle
    ci = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    assert ci["jobs"]["test"]["runs-on"] == "ubuntu-latest"
    assert "bash .ci/run" in json.dumps(ci["jobs"]["test"]["steps"])


def test_rolled_back_variant_that_main_accepts_fails() -> None:
    base = {"float16": {"accepted": 1}, "bfloat16": {"accepted": 0}}
    assert compare_decisions.regressions(base, {"float16": {"accepted": 1}, "bfloat16": {"accepted": 0}}) == ([], [])
    problems, _ = compare_decisions.regressions(base, {"float16": {"accepted": 0}, "bfloat16": {"accepted": 1}})
    assert problems == ["float16: accepted on the base branch, rolled back in this run"]
    problems, notes = compare_decisions.regressions(base, {"bfloat16": {"accepted": 1}})
    assert problems == ["float16: accepted on the base branch, not decided in this run"]
    assert notes == ["bfloat16: rolled back on the base branch, accepted in this run"]


def test_compare_decisions_against_a_git_ref(tmp_path: Path) -> None:
    """The script as the GPU workflow runs it: committed decisions on a ref against this run's files."""
    metrics = tmp_path / "data" / "metrics"
    metrics.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    (metrics / "decision-float16.json").write_text('{"accepted": 1, "reasons": 0}')
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "decisions"], cwd=tmp_path, check=True)
    script = [sys.executable, str(ROOT / "scripts" / "compare_decisions.py"), "--base-ref", "main"]
    assert subprocess.run(script, cwd=tmp_path, capture_output=True, check=False).returncode == 0
    (metrics / "decision-float16.json").write_text('{"accepted": 0, "reasons": 2}')
    proc = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "float16: accepted on the base branch, rolled back" in proc.stderr
