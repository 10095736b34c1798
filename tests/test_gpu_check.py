"""scripts/gpu_check.py and its harness scripts/_project.py without running a pipeline: the stage plan is
dvc.yaml's, the runs' params come from examples/, a copy is the working tree, and --require-gpu."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import _project
import pytest
import torch
import yaml
from _project import ROOT

import gpu_check
from pipeline import transforms

FLOAT8 = transforms.float8_torch() and bool(importlib.util.find_spec("torchao"))


def test_plan_is_dvc_yaml_with_its_matrix_stages_once_per_dtype() -> None:
    params = {**_project.params(), "trial": {"variants": ["float16", "bfloat16"]}}
    plan = _project.plan(params)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    dtypes = params["trial"]["variants"]
    expected = [f"{n}@{d}" if "matrix" in s else n for n, s in stages.items() for d in (dtypes if "matrix" in s else [""])]
    assert [s.name for s in plan] == expected
    assert expected[:3] == ["prepare", "freeze", "trial@float16"] and expected[-1] == "publish"
    trial = next(s for s in plan if s.name == "trial@bfloat16")
    assert trial.cmd == ("python", "-m", "pipeline", "trial", "--variant", "bfloat16")
    assert trial.argv()[0] == sys.executable and trial.argv()[1:] == list(trial.cmd[1:])


def test_the_runs_are_the_example_files_at_each_size() -> None:
    runs, notes = gpu_check.profiles("gpu", None, force_transformer=True, dtypes=["float16"])
    example = _project.example("transformer")
    assert runs["transformer"] == {**example, "trial": {**example["trial"], "variants": ["float16"]}}
    assert runs["transformer"]["task"]["options"]["d_model"] == 768
    assert runs["default"]["task"]["options"] == _project.size("transformer-cpu")["task"]["options"]
    assert "--task transformer" in notes["default"]
    tiny, _ = gpu_check.profiles("tiny", "transformer", force_transformer=False, dtypes=None)
    reference = tiny["transformer"]["reference"]
    assert reference["train_steps"] == 40 and reference["checkpoint_every"] == 0 and reference["optimizer"] == "adam"
    assert tiny["transformer"]["prepare"]["ordinary_cases"] == _project.size("tiny")["prepare"]["ordinary_cases"]
    assert tiny["transformer"]["acceptance"]["min_quality"] == 0.5, "the example's rule, not params.yaml's"
    # the variants beyond autocast, on the same transformer: compiled and float8 (torch 2.13 and torchao 0.18 here;
    # on an older torch, or without torchao, float8 is left out with a note: scripts/oldest_torch.sh's torch 2.4.1)
    if FLOAT8:
        assert runs["variants"]["trial"]["variants"] == ["bfloat16_inductor", "float8_tensorwise"] and "variants" not in notes
    else:
        assert runs["variants"]["trial"]["variants"] == ["bfloat16_inductor"]
        assert "float8_tensorwise left out" in notes["variants"]
    assert runs["variants"]["task"] == runs["transformer"]["task"]


def test_a_copy_holds_the_working_tree_as_git_sees_it(tmp_path: Path) -> None:
    """Tracked and untracked files of the project's folders go, with the bytecode of their modules (compiled here, so
    that the copy's processes need not compile them); ignored ones and everything else stay."""
    src = tmp_path / "src"
    (src / "pipeline" / "__pycache__").mkdir(parents=True)
    (src / "params.yaml").write_text(
        yaml.safe_dump({"seed": 0, "trial": {"variants": ["float16", "bfloat16"], "fp32_modules": []}})
    )
    (src / ".gitignore").write_text("__pycache__/\n")
    (src / "dvc.yaml").write_text("stages: {}\n")
    (src / "pipeline" / "tracked.py").write_text("A = 1\n")
    (src / "notes.txt").write_text("not the project's\n")
    _project.run(["git", "init", "-q"], src)
    _project.run(["git", "add", "-A"], src)
    (src / "pipeline" / "untracked.py").write_text("B = 2\n")  # an edit not yet committed runs in the copy too
    (src / "pipeline" / "__pycache__" / "tracked.cpython.pyc").write_bytes(b"ignored")
    repo = _project.copy(tmp_path / "repo", override={"seed": 7, "trial": {"variants": ["float16"]}}, root=src)
    files = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    tag = sys.implementation.cache_tag  # and this interpreter's bytecode of the copied modules, compiled afresh
    assert files == [".gitignore", "dvc.yaml", "params.yaml", f"pipeline/__pycache__/tracked.{tag}.pyc",
                     f"pipeline/__pycache__/untracked.{tag}.pyc", "pipeline/tracked.py", "pipeline/untracked.py"]
    params = _project.params(repo)
    assert params == {"seed": 7, "trial": {"variants": ["float16"], "fp32_modules": []}}, "a mapping merges key by key"
    # Without git (a folder copied into a bare image): the same folders, less Python's caches.
    shutil.rmtree(src / ".git")
    bare = _project.copy(tmp_path / "bare", root=src)
    assert sorted(p.relative_to(bare).as_posix() for p in bare.rglob("*") if p.is_file()) == files


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --require-gpu lets the check run")
def test_require_gpu_without_one_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), str(out), "--require-gpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists()
