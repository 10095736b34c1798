"""publish's no-op: a key already published to the local sqlite store is found from the project's own record,
without importing MLflow and without reading MLflow's tables; any write to the store since sends it to MLflow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from _project import ROOT
from conftest import blank_mlflow_db

PUBLISH = """
import sys
from pipeline import tracking
publisher = tracking.Publisher("exp", uri=sys.argv[1])
spec = lambda name: tracking.RunSpec(name=name, tags={"stage": "test"}, metrics={"m": 1.0})
print(publisher.publish("k-loose", spec("loosened"), [], remember=False).run_id)
print(publisher.publish("k-done", spec("parent"), [spec("child")]).run_id)  # last: a write after it would outdate the record
"""

LOOK_UP = """
import sys
from pipeline import tracking
for key, exp in (("k-done", "exp"), ("k-loose", "exp"), ("k-none", "exp"), ("k-done", "other")):
    found = tracking.published(sys.argv[1], exp, key)
    print(key, exp, found.run_id if found else None)
print("mlflow imported:", "mlflow" in sys.modules)
"""


def publish(uri: str) -> list[str]:
    """The run ids PUBLISH prints, past publish's note on a dirty checkout (``provenance``)."""
    printed = subprocess.run([sys.executable, "-c", PUBLISH, uri], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return [line for line in printed.splitlines() if not line.startswith("publish: note:")]


def look_up(uri: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", LOOK_UP, uri], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.splitlines()


def test_a_recorded_key_is_found_without_mlflow_until_the_store_changes(tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(blank_mlflow_db(), db)
    uri = f"sqlite:///{db}"
    _, done = publish(uri)
    record = json.loads((tmp_path / ".mlflow-published.json").read_text())
    assert list(record[uri]["published"]["exp"]) == ["k-done"]  # a tree published with remember=False is not recorded
    assert look_up(uri) == [
        f"k-done exp {done}", "k-loose exp None", "k-none exp None", "k-done other None", "mlflow imported: False",
    ]

    # The run deleted in the UI: the store changed since the record, so the caller asks MLflow, which finds nothing.
    code = f"import mlflow; mlflow.MlflowClient(tracking_uri={uri!r}).delete_run({done!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert look_up(uri)[0] == "k-done exp None"
    # A publish after it records the new tree against the store as it is now.
    _, again = publish(uri)
    assert again != done and look_up(uri)[0] == f"k-done exp {again}"


def test_other_stores_and_broken_records_take_the_mlflow_path(tmp_path):
    from pipeline import tracking

    assert tracking.published("http://127.0.0.1:9", "exp", "k") is None
    assert tracking.published(f"sqlite:///{tmp_path / 'absent.db'}", "exp", "k") is None
    (tmp_path / "junk.db").write_bytes(b"not a database")
    (tmp_path / ".mlflow-published.json").write_text("{not json")
    assert tracking.published(f"sqlite:///{tmp_path / 'junk.db'}", "exp", "k") is None
    uri = f"sqlite:///{tmp_path / 'junk.db'}"
    (tmp_path / ".mlflow-published.json").write_text(
        json.dumps({uri: {"stamp": [0], "published": {"exp": {"k": {"run_id": "r", "experiment_id": "1"}}}}})
    )
    assert tracking.published(uri, "exp", "k") is None  # a record of another state of the store
