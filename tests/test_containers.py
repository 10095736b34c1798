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
import torch
import yaml
from _project import BIN, ROOT

from pipeline import devices

sys.path.insert(0, str(ROOT / "scripts"))
import check_locks
import compare_decisions

DOCKERFILES = check_locks.DOCKERFILES


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
    assert ("COPY", "requirements.lock requirements-dev.lock /tmp/") in steps
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


def image_python(dockerfile: str) -> str:
    """The Python the Dockerfile declares for its base image (``ARG PYTHON=3.12``), checked by its build."""
    return check_locks.declared_python((ROOT / dockerfile).read_text())


def test_both_images_install_the_same_way() -> None:
    """Only the base image, its Python and the comments differ: the same locks, installed the same way."""
    cuda, rocm = ([s for s in instructions(f)[1:] if not s[1].startswith("PYTHON=")] for f in DOCKERFILES)
    assert cuda == rocm


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_build_checks_its_python_and_lets_the_user_reach_gpu_nodes(dockerfile: str) -> None:
    steps = instructions(dockerfile)
    version = image_python(dockerfile)
    assert tuple(map(int, version.split("."))) >= (3, 11), f"{dockerfile}: the locks need Python 3.11 or newer"
    base = next(a for w, a in steps if w == "FROM")
    if "_py3." in base:  # the ROCm tag says its Python: the declaration must agree
        assert f"_py{version}_" in base
    runs = [a for w, a in steps if w == "RUN"]
    assert "sys.version_info[:2]" in runs[0] and "${PYTHON}" in runs[0], "the first RUN stops on another Python"
    assert any("usermod -aG" in r and "render" in r and "video" in r for r in runs), "the user joins video and render"
    assert [w for w, _ in steps].index("USER") > max(i for i, (w, a) in enumerate(steps) if "usermod" in a)


def test_lock_has_no_torch_and_dockerignore_sends_only_the_locks() -> None:
    for lock in ("requirements.lock", "requirements-dev.lock"):
        names = [re.split(r"[=<>\[ ]", line)[0].lower() for line in (ROOT / lock).read_text().splitlines() if line.strip()]
        # no CUDA runtime wheels (nvidia-cublas-cu12...): the images bring their own; NVML's pure-Python bindings are fine
        cuda_wheels = [n for n in names if n.startswith("nvidia-") and n != "nvidia-ml-py"]
        assert "torch" not in names and not cuda_wheels, lock
    lines = [l for l in (ROOT / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert lines == ["*", "!requirements.lock", "!requirements-dev.lock"]


def test_lock_check_judges_each_python_and_its_control(tmp_path: Path) -> None:
    """scripts/check_locks.py (run by .ci/run: it asks the package index, which the tests do not): what it accepts."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [{}] * 3}))
    assert check_locks.verdict("3.12", 0, "", report, 3) is None
    assert "resolved 3 packages for 4" in check_locks.verdict("3.12", 0, "", report, 4)
    assert "could not resolve" in check_locks.verdict("3.11", 1, "No matching distribution", report, 3)
    refused = "ERROR: Package 'dvc' requires a different Python: 3.10.0 not in '>=3.11'; Requires-Python >=3.11"
    assert check_locks.verdict(check_locks.CONTROL, 1, refused, report, 3) is None
    assert "control" in check_locks.verdict(check_locks.CONTROL, 0, "", report, 3)  # a control that passes proves nothing
    assert "control" in check_locks.verdict(check_locks.CONTROL, 1, "network unreachable", report, 3)
    assert len(check_locks.pinned()) > 50
    with pytest.raises(ValueError, match="once"):
        check_locks.declared_python("FROM x\nARG PYTHON=3.11\nARG PYTHON=3.12\n")


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
        "compare_decisions.py --base-ref origin/main --expect-backend \\\"${{ matrix.backend }}\\\"",
        "getent group render | cut -d: -f3",  # ROCm: the host's render gid
        "python3 -m pytest -m gpu",  # the gpu-marked tests, inside the image
        "device: cuda",  # never the CPU fallback
        "python3 -m pipeline.devices cuda",  # fails in one line when no GPU is visible
    ):
        assert needle in text, needle
    names = [step.get("name", "") for step in job["steps"]]
    order = [
        next(i for i, n in enumerate(names) if key in n) for key in ("render gid", "Ask for the GPU", "gpu-marked", "dvc repro")
    ]
    assert order == sorted(order), "flags, then the GPU check, the gpu tests and the pipeline"
    every_run = [
        step["run"] for step in job["steps"] if "docker run" in step.get("run", "") and "compare_decisions" not in step["run"]
    ]
    assert every_run and all("$GPU_ARGS" in r for r in every_run), "every GPU container gets the GPU flags"


def test_readme_rocm_commands_add_the_render_gid() -> None:
    readme = (ROOT / "README.md").read_text()
    rocm_runs = [l for l in readme.splitlines() if "docker run" in l and "amp-validation:rocm" in l]
    assert rocm_runs and all("--group-add video" in l and '$(getent group render | cut -d: -f3)' in l for l in rocm_runs)
    ci = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    assert ci["jobs"]["test"]["runs-on"] == "ubuntu-latest"
    assert "bash .ci/run" in json.dumps(ci["jobs"]["test"]["steps"])


def test_rolled_back_variant_that_main_accepts_fails() -> None:
    base = {"float16": {"decision": 1}, "bfloat16": {"accepted": 0}}  # decide's metrics, or the older format
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
    (metrics / "decision-float16.json").write_text('{"accepted": 1, "reasons": 0}')  # an older commit's format
    (metrics / "compare-float16.json").write_text('{"flips": 0}')  # not a decision: ignored
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "decisions"], cwd=tmp_path, check=True)
    (metrics / "decision-float16.json").unlink()
    script = [sys.executable, str(ROOT / "scripts" / "compare_decisions.py"), "--base-ref", "main"]
    (metrics / "float16.json").write_text('{"decision": 1, "reasons": 0}')
    assert subprocess.run(script, cwd=tmp_path, capture_output=True, check=False).returncode == 0
    (metrics / "float16.json").write_text('{"decision": 0, "reasons": 2}')
    proc = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "float16: accepted on the base branch, rolled back" in proc.stderr
    (metrics / "float16.json").write_text('{"decision": "rollback", "reasons": 2}')  # this version writes the word
    proc = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "rolled back" in proc.stderr
    (metrics / "float16.json").write_text('{"decision": "accept", "reasons": 0}')
    assert subprocess.run(script, cwd=tmp_path, capture_output=True, check=False).returncode == 0


def test_compare_decisions_fails_when_another_backend_ran(tmp_path: Path) -> None:
    """Issue 12.2: a GPU leg whose runs went to the CPU fails, naming each record; a missing trial fails too."""
    data = tmp_path / "data"

    def record(path: str, backend: str, **extra) -> None:
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_text(json.dumps({"env": {"backend": backend}, **extra}))

    assert any("missing" in p for p in compare_decisions.backend_problems(data, "cuda"))
    record("reference/manifest.json", "cuda")
    record("trial/float16/manifest.json", "cuda")
    record("trial/bfloat16/manifest.json", "cuda")
    record("benchmark/float16/benchmark.json", "cuda", benchmarked=True)
    (data / "benchmark/bfloat16").mkdir(parents=True)
    (data / "benchmark/bfloat16/benchmark.json").write_text('{"benchmarked": false}')
    assert compare_decisions.backend_problems(data, "cuda") == []
    record("trial/bfloat16/manifest.json", "cpu")
    assert compare_decisions.backend_problems(data, "cuda") == [f"{data}/trial/bfloat16/manifest.json: ran on cpu, not cuda"]
    assert len(compare_decisions.backend_problems(data, "rocm")) == 4


def test_device_cuda_without_a_gpu_fails_in_one_line(capsys: pytest.CaptureFixture) -> None:
    """What the GPU job's first check runs (``python3 -m pipeline.devices cuda``): no GPU visible means exit 2
    and one line, never the CPU."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the gpu-marked tests cover this machine")
    assert devices._main(["cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "device: cuda was asked for but no CUDA or ROCm GPU is visible" in err
    assert devices._main(["cpu"]) == 0 and json.loads(capsys.readouterr().out)["backend"] == "cpu"


def test_rocm_device_node_out_of_reach_is_named_with_its_gid(tmp_path: Path) -> None:
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    kfd.chmod(0o660)
    gid = kfd.stat().st_gid
    problem = devices.device_node_problem("7.2", kfd, uid=1000, groups=[gid + 1])
    assert problem and f"--group-add {gid}" in problem and "getent group render" in problem and "\n" not in problem
    assert devices.device_node_problem("7.2", kfd, uid=1000, groups=[gid]) is None
    assert devices.device_node_problem(None, kfd, uid=1000, groups=[]) is None, "CUDA builds: not a ROCm matter"
    assert devices.device_node_problem("7.2", tmp_path / "absent", uid=1000, groups=[]) is None
