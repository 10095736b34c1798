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
