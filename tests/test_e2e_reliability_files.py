"""No stage deletes or writes through a symlink, or outside the repository (issue 24, item 4)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from _project import run, write_params

from pipeline.files import check_inside_repository, write_bytes
from pipeline.errors import UserError


def test_a_symlinked_or_escaping_output_folder_is_refused(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    monkeypatch.chdir(repo)
    os.symlink(outside, repo / "data" / "report")
    with pytest.raises(UserError, match=r"data/report is a symlink .*a stage never writes or deletes through one"):
        write_bytes(Path("data/report/plots/float16/loss.png"), b"png")
    with pytest.raises(UserError, match="outside the repository"):
        check_inside_repository(Path("../outside"))
    write_bytes(Path("data/real/file.bin"), b"ok")  # a real folder inside the repository is fine
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_report_never_deletes_through_a_symlink_nor_files_it_did_not_write(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    plots = repo / "data/report/plots"
    # Files the stage does not own, in its own folder, are left alone; a stale figure of the stage is pruned.
    (plots / "float16" / "notes.txt").write_text("mine")
    (plots / "float32").mkdir()
    (plots / "float32" / "loss.png").write_bytes(b"not a dtype the stage knows: not its file")
    unknown = plots / "bfloat16" / "old.png"
    unknown.write_bytes(b"x")
    write_params(repo, {"trial": {"variants": ["float16"]}})
    done = run([sys.executable, "-m", "pipeline", "report"], repo)
    assert not (plots / "bfloat16" / "loss.png").exists()  # the stage's own figure of a dtype no longer configured
    assert (plots / "float16" / "notes.txt").read_text() == "mine"
    assert (plots / "float32" / "loss.png").exists() and unknown.exists()  # not figure names the stage writes

    # data/report/plots as a symlink to a folder outside the repository: refused in one line, nothing deleted.
    outside = tmp_path / "outside"
    shutil.move(plots, outside)
    (outside / "keep.txt").write_text("precious")
    os.symlink(outside, plots)
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    refused = run([sys.executable, "-m", "pipeline", "report"], repo, check=False)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert refused.stderr.startswith("error: data/report/plots is a symlink") and "rm data/report/plots" in refused.stderr
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert done.returncode == 0
