"""Publish's stuck or noisy failures (issue 24, items 6, 8, 9), against real MLflow stores: a sqlite file
that another process holds locked, names MLflow refuses, a publish that fails midway."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import blank_mlflow_db

from pipeline import tracking
from pipeline.errors import UserError

HOLD = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _db(tmp_path: Path) -> Path:
    db = tmp_path / "mlflow.db"
    shutil.copy(blank_mlflow_db(), db)
    return db


def _hold(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the database in an exclusive transaction (as a writer or a migration does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_locked_sqlite_store_is_one_line(tmp_path, monkeypatch):
    db = _db(tmp_path)
    monkeypatch.setattr(tracking, "SQLITE_BUSY_S", 1)
    holder = _hold(db, 120)
    try:
        with pytest.raises(UserError) as err:
            tracking.Publisher("amp-validation", f"sqlite:///{db}")
    finally:
        holder.kill()
        holder.wait()
    line = str(err.value)
    assert "\n" not in line and f"MLflow store {db} is locked by another process" in line and "rerun `python -m pipeline publish`" in line


def test_a_short_lock_is_waited_out(tmp_path, monkeypatch):
    db = _db(tmp_path)
    monkeypatch.setattr(tracking, "SQLITE_BUSY_S", 30)
    holder = _hold(db, 3)
    start = time.monotonic()
    try:
        publisher = tracking.Publisher("amp-validation", f"sqlite:///{db}")
    finally:
        holder.wait()
    assert publisher.experiment_id and time.monotonic() - start >= 2  # it waited for the lock, then went on
