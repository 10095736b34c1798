"""Atomic, deterministic file writes (pipeline/files.py)."""

from __future__ import annotations

import os
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
