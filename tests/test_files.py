"""Atomic, deterministic file writes (pipeline/files.py)."""

from __future__ import annotations

import errno
import os
import re
import stat

import pytest

from pipeline import files


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_outputs_get_the_mode_a_plain_open_would(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        files.write_bytes(tmp_path / "atomic.bin", b"x")
        files.write_json(tmp_path / "atomic.json", {"a": 1})
        with open(tmp_path / "plain.bin", "wb") as handle:
            handle.write(b"x")
        assert files.current_umask() == mask
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plain.bin").stat().st_mode) == mode
    for name in ("atomic.bin", "atomic.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# --- a folder replaced all together or not at all (issue 50, item 5) ---------------------------------------------


def _contents(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _old_outputs(folder):
    folder.mkdir(parents=True)
    (folder / "outputs.bin").write_bytes(b"old outputs" * 100)
    (folder / "manifest.json").write_text('{"old": true}')
    return _contents(folder)


def test_a_folder_is_replaced_all_together_or_not_at_all(tmp_path):
    folder = tmp_path / "data" / "trial" / "float16"
    before = _old_outputs(folder)
    with pytest.raises(RuntimeError, match="midway"), files.StagedFolder(folder) as new:
        files.write_bytes(new / "outputs.bin", b"new outputs")
        raise RuntimeError("midway")
    assert _contents(folder) == before  # nothing of the new set, nothing of the old one lost
    assert sorted(p.name for p in folder.parent.iterdir()) == ["float16"]  # no pending folder left
    with files.StagedFolder(folder) as new:
        files.write_bytes(new / "outputs.bin", b"new outputs")
        files.write_json(new / "manifest.json", {"new": True})
    assert _contents(folder) == {"manifest.json": b'{\n  "new": true\n}\n', "outputs.bin": b"new outputs"}
    assert sorted(p.name for p in folder.parent.iterdir()) == ["float16"]  # no .float16.old left either


def test_a_full_disk_leaves_the_previous_outputs_and_says_so_in_one_line(tmp_path):
    folder = tmp_path / "data" / "compare" / "float16"
    before = _old_outputs(folder)
    with pytest.raises(files.DiskFull) as raised, files.StagedFolder(folder) as new:
        files.write_bytes(new / "outputs.bin", b"x" * 10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    line = str(raised.value)
    assert "\n" not in line and isinstance(raised.value, files.UserError)
    assert re.fullmatch(
        rf"no space left on {re.escape(str(folder))}'s filesystem \(\S+ \S+ free, about 1\.1 KB needed, the size of the "
        r"previous outputs\): free space or move data/ \(the previous outputs are intact\)", line
    ), line
    assert _contents(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["float16"]
    # No previous outputs (DVC removed them before the stage ran): what was written is the floor of what is needed.
    fresh = tmp_path / "data" / "compare" / "bfloat16"
    with pytest.raises(files.DiskFull, match=r"at least 2\.0 KB needed, what was written before it filled"):
        with files.StagedFolder(fresh) as new:
            files.write_bytes(new / "table.json", b"x" * 2000)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert not fresh.exists() and sorted(p.name for p in fresh.parent.iterdir()) == ["float16"]


def test_a_switch_cut_between_its_two_renames_is_undone_at_the_next_start(tmp_path):
    folder = tmp_path / "data" / "reference"
    before = _old_outputs(folder)
    os.rename(folder, tmp_path / "data" / ".reference.old")  # killed right after the first rename
    (tmp_path / "data" / ".reference.pending").mkdir()
    (tmp_path / "data" / ".reference.pending" / "outputs.bin").write_bytes(b"half")
    with pytest.raises(RuntimeError), files.StagedFolder(folder):
        raise RuntimeError("this run fails too")
    assert _contents(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["reference"]


def test_an_owner_replaces_its_folder_all_together(tmp_path, monkeypatch):
    """diagnosis.write's two files: the disk fills on the second, and the first is not left beside the old second."""
    from pipeline.artifacts import diagnosis

    monkeypatch.chdir(tmp_path)
    diagnosis.write("float16", diagnosis.Diagnosis(), "old: suggestion\n")
    folder = tmp_path / "data" / "diagnose" / "float16"
    before = _contents(folder)
    plain, calls = files.atomic_file, []

    def fills_on_the_second_file(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return plain(path)

    monkeypatch.setattr(files, "atomic_file", fills_on_the_second_file)
    with pytest.raises(files.DiskFull, match="no space left on data/diagnose/float16's filesystem"):
        diagnosis.write("float16", diagnosis.Diagnosis(needed=True), "new: suggestion\n")
    assert _contents(folder) == before


def test_a_full_disk_outside_a_staged_folder_is_one_line(tmp_path, monkeypatch, capsys):
    from pipeline import __main__ as entry
    from pipeline.stages import prepare

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("")

    def fills(**_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "data/resume/.reference.safetensors.x.tmp")

    monkeypatch.setattr(prepare, "main", fills)
    assert entry.main(["prepare"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on data/resume's filesystem (") and err.count("\n") == 1, err
    assert "free space or move data/ (the previous outputs are intact)" in err


def test_a_folder_whose_outputs_are_files_keeps_what_the_stage_does_not_own(tmp_path):
    """``data/prepared`` holds DVC's ``.gitignore`` beside the two files prepare writes: a switch carries it (and a
    user's note) into the new set; only the owned files change. A predicate says what is owned too (report's folders:
    a variant no longer run loses its figures, a file of someone else's stays)."""
    folder = tmp_path / "data" / "prepared"
    folder.mkdir(parents=True)
    (folder / ".gitignore").write_text("/cases.safetensors\n/train.safetensors\n")
    (folder / "cases.safetensors").write_bytes(b"old cases")
    (folder / "notes" / "mine.txt").parent.mkdir()
    (folder / "notes" / "mine.txt").write_text("keep me")
    with files.StagedFolder(folder, owned={"cases.safetensors", "train.safetensors"}) as new:
        files.write_bytes(new / "cases.safetensors", b"new cases")
        files.write_bytes(new / "train.safetensors", b"new train")
    assert _contents(folder) == {".gitignore": b"/cases.safetensors\n/train.safetensors\n", "cases.safetensors": b"new cases",
                                 "notes/mine.txt": b"keep me", "train.safetensors": b"new train"}
    plots = tmp_path / "data" / "report" / "plots"
    for rel in ("gone/loss.png", "float16/loss.png", "float16/mine.txt"):
        (plots / rel).parent.mkdir(parents=True, exist_ok=True)
        (plots / rel).write_bytes(b"old")
    with files.StagedFolder(plots, owned=lambda rel: rel.suffix == ".png") as new:
        files.write_bytes(new / "float16" / "loss.png", b"new")
    assert _contents(plots) == {"float16/loss.png": b"new", "float16/mine.txt": b"old"}


def test_a_staged_file_beside_a_staged_folder_is_switched_with_it_or_not_at_all(tmp_path):
    """benchmark's record (its folder) and its DVC metric (a file in the shared data/metrics): a full disk on either
    leaves both as they were, in one line naming the folder that filled; success switches both."""
    folder, metric = tmp_path / "data" / "benchmark" / "float16", tmp_path / "data" / "metrics" / "bench-float16.json"
    folder.mkdir(parents=True)
    metric.parent.mkdir(parents=True)
    (folder / "benchmark.json").write_text("old record")
    metric.write_text("old metric")
    for fails in ("record", "metric"):
        with pytest.raises(files.DiskFull) as raised:
            with files.StagedFolder(folder, owned={"benchmark.json"}) as out, files.StagedFile(metric) as m:
                files.write_bytes(out / "benchmark.json", b"new record")
                if fails == "record":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                files.write_bytes(m, b"new")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        line = str(raised.value)
        assert "\n" not in line and line.startswith("no space left on "), line
        assert (folder / "benchmark.json").read_text() == "old record" and metric.read_text() == "old metric"
        assert sorted(p.name for p in metric.parent.iterdir()) == ["bench-float16.json"]
        assert sorted(p.name for p in folder.parent.iterdir()) == ["float16"]
    with files.StagedFolder(folder, owned={"benchmark.json"}) as out, files.StagedFile(metric) as m:
        files.write_bytes(out / "benchmark.json", b"new record")
        files.write_bytes(m, b"new metric")
    assert (folder / "benchmark.json").read_text() == "new record" and metric.read_text() == "new metric"
    assert sorted(p.name for p in metric.parent.iterdir()) == ["bench-float16.json"]


def test_nested_staged_folders_switch_together_and_a_full_disk_is_said_once_by_the_outer_one(tmp_path):
    """report's two folders: a full disk while writing the outer one's files, or the inner one's, leaves both as they
    were, and the one line names the outer folder with what both need."""
    plots, curves = tmp_path / "data" / "report" / "plots", tmp_path / "data" / "report" / "curves"
    for folder in (plots, curves):
        _old_outputs(folder)
    before = {f: _contents(f) for f in (plots, curves)}
    for fails in ("outer", "inner"):
        with pytest.raises(files.DiskFull) as raised:
            with files.StagedFolder(plots) as p, files.StagedFolder(curves) as c:
                files.write_bytes(c / "loss.json", b"new")
                files.write_bytes(p / "loss.png", b"new")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(p if fails == "outer" else c))
        line = str(raised.value)
        assert line.startswith(f"no space left on {plots}'s filesystem (") and "about 2.2 KB needed" in line, line
        assert {f: _contents(f) for f in (plots, curves)} == before
        assert sorted(p.name for p in plots.parent.iterdir()) == ["curves", "plots"]
    with files.StagedFolder(plots) as p, files.StagedFolder(curves) as c:
        files.write_bytes(c / "loss.json", b"new")
        files.write_bytes(p / "loss.png", b"new")
    assert (_contents(plots), _contents(curves)) == ({"loss.png": b"new"}, {"loss.json": b"new"})
