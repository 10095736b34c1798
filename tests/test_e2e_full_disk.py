"""A full disk loses no outputs (issue 50, item 5): a stage whose filesystem fills up midway leaves its previous
outputs as they were (the same files, not rewritten), says so in one line naming the folder and the space, and
`dvc status` still says the stage must run.

The disk fills by injection (``faults.disk_full``: the stage's writes raise ENOSPC after N bytes), not by a small
mount: the same bytes fail on every machine, as root or not.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from _project import dvc, dvc_cmd, env_for, run, write_params

import faults

pytestmark = pytest.mark.integration


def files_of(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Each file's inode and bytes: a file rewritten with the same bytes (os.replace) has another inode."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def staged_beside(folder: Path) -> list[str]:
    """What a switch of ``folder`` left beside it: a pending new set, a previous one."""
    return [p.name for p in folder.parent.iterdir() if p.name in (f".{folder.name}.pending", f".{folder.name}.old")]


def full_disk(repo: Path, folder: str, after_bytes: int) -> dict[str, str]:
    """The stage's writes to ``folder`` (and to the new set it stages beside it) fail after ``after_bytes`` bytes."""
    return faults.disk_full(env_for(repo), after_bytes, folder)


ALSO = {"benchmark": "data/metrics/bench-bfloat16.json", "report": "data/report/curves"}
"""What a stage writes beside its folder, switched with it: left as it was too."""


def files_at(path: Path) -> dict[str, tuple[int, bytes]]:
    return files_of(path) if path.is_dir() else {path.name: (path.stat().st_ino, path.read_bytes())}


# freeze and the trial hold several tensors files; decide@bfloat16 (a rollback in the tiny run) holds its package;
# prepare's folder holds DVC's .gitignore beside its two files; benchmark@bfloat16 (not benchmarked: a rollback) its
# record and a metric in data/metrics; report its figures, and its curves in a second folder.
@pytest.mark.parametrize("stage, folder", [
    ("freeze", "data/reference"),
    ("trial@float16", "data/trial/float16"),
    ("compare@float16", "data/compare/float16"),
    ("diagnose@float16", "data/diagnose/float16"),
    ("decide@bfloat16", "data/decision/bfloat16"),
    ("prepare", "data/prepared"),
    ("benchmark@bfloat16", "data/benchmark/bfloat16"),
    ("report", "data/report/plots"),
])
def test_a_full_disk_midway_leaves_the_previous_outputs_and_says_so_in_one_line(reproduced, tmp_path, stage, folder):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    before = files_of(repo / folder)
    also = ALSO.get(stage.partition("@")[0])
    beside = files_at(repo / also) if also else None
    name, _, variant = stage.partition("@")
    half = sum(len(data) for _, data in before.values()) // 2  # the disk fills half-way through the new set
    args = [sys.executable, "-m", "pipeline", name] + (["--variant", variant] if variant else [])
    done = run(args, repo, check=False, env=full_disk(repo, folder, half))
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"error: no space left on {folder}'s filesystem (")
    assert "needed, the size of the previous outputs" in line
    assert line.endswith("free space or move data/ (the previous outputs are intact)"), line
    assert files_of(repo / folder) == before  # the same files, untouched: no mix of old and new
    assert not staged_beside(repo / folder)
    if also:
        assert files_at(repo / also) == beside and not staged_beside(repo / also)


def test_under_dvc_repro_a_full_disk_keeps_the_lock_and_the_stage_must_rerun(reproduced, tmp_path):
    """The trial of the issue: the disk fills after its two streamed outputs, in its checkpoint. DVC removed the old
    outputs before the stage ran (they are in its cache); dvc.lock still names them, `dvc checkout` brings them back
    byte for byte, and `dvc status` lists the stage."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    trial = repo / "data/trial/float16"
    before = {name: data for name, (_, data) in files_of(trial).items()}
    lock = (repo / "dvc.lock").read_bytes()
    write_params(repo, {"trial": {"policies": {"float16": {"dtype": "bfloat16"}}}})  # a new trial to run, other bytes
    streamed = len(before["outputs.safetensors"]) + len(before["trained_outputs.safetensors"])

    failed = run(dvc_cmd("repro", "trial@float16"), repo, check=False,
                 env=full_disk(repo, "data/trial/float16", streamed + 1024))
    assert failed.returncode != 0
    assert "error: no space left on data/trial/float16's filesystem (" in failed.stderr + failed.stdout
    assert "Traceback" not in failed.stderr + failed.stdout
    assert (repo / "dvc.lock").read_bytes() == lock  # the stage did not complete: nothing recorded
    assert not staged_beside(trial)
    status = dvc(repo, "status", "trial@float16").stdout
    assert "trial@float16:" in status, status  # it must rerun

    dvc(repo, "checkout", "trial@float16")
    assert {name: data for name, (_, data) in files_of(trial).items()} == before


@pytest.mark.parametrize("stage, folder, cached", [
    ("prepare", "data/prepared", True),
    ("benchmark@bfloat16", "data/benchmark/bfloat16", False),
    ("report", "data/report/plots", True),
])
def test_under_dvc_repro_a_full_disk_in_prepare_benchmark_or_report_keeps_the_lock_and_the_stage_must_rerun(
        reproduced, tmp_path, stage, folder, cached):
    """The stages written through ``files.StagedFolder`` last (issue 50.5): forced to run again, each fills the disk
    half-way through its folder; the lock stays, `dvc status` lists the stage, `dvc checkout` restores cached outputs
    (benchmark's are kept in git: cache false)."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    before = files_of(repo / folder)
    lock = (repo / "dvc.lock").read_bytes()
    half = sum(len(data) for _, data in before.values()) // 2
    failed = run(dvc_cmd("repro", "--force", "--single-item", stage), repo, check=False, env=full_disk(repo, folder, half))
    out = failed.stderr + failed.stdout
    assert failed.returncode != 0, out[-3000:]
    assert f"error: no space left on {folder}'s filesystem (" in out and "Traceback" not in out, out[-3000:]
    assert (repo / "dvc.lock").read_bytes() == lock
    assert not staged_beside(repo / folder)
    status = dvc(repo, "status", stage).stdout
    assert f"{stage}:" in status, status
    if cached:
        dvc(repo, "checkout", stage)
        assert {n: d for n, (_, d) in files_of(repo / folder).items()} == {n: d for n, (_, d) in before.items()}
