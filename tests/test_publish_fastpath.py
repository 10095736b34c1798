"""publish's no-op: a key already published in the local sqlite store is found without importing MLflow."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import ROOT, blank_mlflow_db

MAKE_RUNS = """
import sys, mlflow
client = mlflow.MlflowClient(tracking_uri=sys.argv[1])
exp = client.create_experiment("exp")
done = client.create_run(exp, tags={"amp.key": "k-done"})
client.set_terminated(done.info.run_id, "FINISHED")
client.create_run(exp, tags={"amp.key": "k-live"})  # a publish in progress
for _ in range(2):  # two finished trees of one key: duplicates that only the MLflow path cleans up
    dup = client.create_run(exp, tags={"amp.key": "k-dup"})
    client.set_terminated(dup.info.run_id, "FINISHED")
print(done.info.run_id)
"""

LOOK_UP = """
import sys
from pipeline import tracking
for key, exp in (("k-done", "exp"), ("k-live", "exp"), ("k-dup", "exp"), ("k-none", "exp"), ("k-done", "other")):
    found = tracking.published_parent(sys.argv[1], exp, key)
    print(key, exp, found.run_id if found else None)
print("mlflow imported:", "mlflow" in sys.modules)
"""


def test_published_key_is_found_with_sqlite3_alone_and_anything_unclear_goes_to_mlflow(tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(blank_mlflow_db(), db)
    uri = f"sqlite:///{db}"
    done = subprocess.run([sys.executable, "-c", MAKE_RUNS, uri], capture_output=True, text=True, check=True).stdout.split()[-1]
    out = subprocess.run([sys.executable, "-c", LOOK_UP, uri], capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    assert out == [
        f"k-done exp {done}",
        "k-live exp None",
        "k-dup exp None",
        "k-none exp None",
        "k-done other None",
        "mlflow imported: False",
    ], out


def test_other_stores_always_take_the_mlflow_path(tmp_path):
    from pipeline import tracking

    assert tracking.published_parent("http://127.0.0.1:9", "exp", "k") is None
    assert tracking.published_parent(f"sqlite:///{tmp_path / 'absent.db'}", "exp", "k") is None
    (tmp_path / "junk.db").write_bytes(b"not a database")
    assert tracking.published_parent(f"sqlite:///{tmp_path / 'junk.db'}", "exp", "k") is None
