"""The tracking store (pipeline/tracking.py) against real MLflow stores, no server: read-only or plain-path stores refused
in one line, the default URI, a sqlite file another process holds locked, names MLflow refuses, a publish that fails
midway, a server that hangs on its API, a project copied with `cp -a` (issue 15; issue 24, items 6, 8, 9, 11)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import blank_mlflow_db

from pipeline import files, provenance, tracking
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


@pytest.mark.integration  # starts a process or a server
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
    assert (
        "\n" not in line and f"MLflow store {db} is locked by another process" in line
        and "rerun `python -m pipeline publish`" in line
    )


@pytest.mark.integration  # starts a process or a server
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


# --- item 6: names MLflow would refuse; a failed publish leaves FAILED runs, redone at once -----------------

NASTY = [
    "we.ird/../key", "outputs./../x.atol", "a//b", "./a", "a/", "..", "/../etc/passwd", "cases.ordinary/../../x", "*", "ok.name",
]


def test_every_sanitised_name_is_one_mlflow_accepts():
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name, _validate_tag_name

    keys = tracking._mlflow_keys(NASTY)
    assert len(set(keys)) == len(NASTY)
    for key in keys:
        _validate_param_name(key)
        _validate_metric_name(key)
        _validate_tag_name(key)
    assert tracking.mlflow_key("ok.name") == "ok.name" and tracking.mlflow_key("we.ird/../key") == "we.ird/__/key"


def _spec(name: str, **kw) -> tracking.RunSpec:
    return tracking.RunSpec(name=name, tags={"stage": "pipeline", **kw.pop("tags", {})}, **kw)


def test_names_from_the_users_data_publish(tmp_path):
    db = _db(tmp_path)
    publisher = tracking.Publisher("amp-validation", f"sqlite:///{db}")
    names = {n: i for i, n in enumerate(NASTY)}
    done = publisher.publish("k-names",
                             _spec("parent", params=names, metrics=names, tags={f"decision_tag.{n}": "x" for n in NASTY}),
                             [_spec("child", metrics={"values./../out.max_abs": 0.5})])
    assert done.created == 2
    run = publisher.client.get_run(done.run_id)
    assert run.data.params["we.ird/__/key"] == "0" and run.data.metrics["we.ird/__/key"] == 0.0


def test_a_failed_publish_marks_its_runs_failed_and_the_next_one_does_not_wait(tmp_path, capsys):
    db = _db(tmp_path)
    publisher = tracking.Publisher("amp-validation", f"sqlite:///{db}", wait_s=5)
    broken = _spec("child", artifacts=[(tmp_path / "gone.json", "")])  # vanished between the check and the upload
    with pytest.raises(UserError) as err:
        publisher.publish("k-fail", _spec("parent"), [_spec("first child"), broken])
    assert "\n" not in str(err.value)
    runs = publisher.client.search_runs([publisher.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FAILED", "FAILED"]  # nothing left RUNNING
    start = time.monotonic()
    again = publisher.publish("k-fail", _spec("parent"), [_spec("first child")])
    assert again.created == 2 and time.monotonic() - start < 5  # no lease to wait for
    live = publisher.client.search_runs([publisher.experiment_id])
    assert sorted(r.info.status for r in live) == ["FINISHED", "FINISHED"]
    assert "waiting" not in capsys.readouterr().err


def test_waiting_for_a_live_publisher_is_said_in_one_line(tmp_path, capsys):
    db = _db(tmp_path)
    publisher = tracking.Publisher("amp-validation", f"sqlite:///{db}", wait_s=1.5)
    publisher._start(_spec("someone else's parent"), {tracking.KEY_TAG: "k-live"})  # RUNNING, fresh heartbeat
    with pytest.raises(UserError, match="is still running"):
        publisher.publish("k-live", _spec("parent"), [])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (
        len(err) == 1 and err[0].startswith("publish: another publish of these results is running")
        and "waiting up to 2 s" in err[0]
    )


# --- item 8: a server that answers /health but hangs on its API ---------------------------------------------


@pytest.fixture
def hanging_server():
    """A real HTTP server on 127.0.0.1: /health answers 200 at once, every API call hangs (a stuck backend)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            if self.path.rstrip("/") == "/health":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")
                return
            release.wait(60)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.integration  # starts a process or a server
def test_a_server_that_hangs_on_its_api_stops_publish_in_seconds_with_a_line_per_retry(hanging_server, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setattr(tracking, "FIRST_CALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(tracking, "FIRST_CALL_ATTEMPTS", 2)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        tracking.Publisher("amp-validation", hanging_server)
    took = time.monotonic() - start
    assert "answers /health but its API did not answer in 2 attempts of 1 s" in str(err.value) and "\n" not in str(err.value)
    assert took < 15, took
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "(attempt 1 of 2); retrying" in lines[0], lines
    assert os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") == "30"  # the later calls keep MLflow's longer timeout


# --- item 11: a copied project publishes into its own artifacts, without SQL; stale files of another dtype -----


def test_a_project_copied_with_cp_a_publishes_into_its_own_mlartifacts(tmp_path, monkeypatch, capsys):
    """A copied mlflow.db keeps the original's artifact location, which MLflow's API cannot change and whose tables
    are not ours to write: what the copy holds already is "already published" (nothing written); what it publishes
    goes to a new experiment of the same name in this project's mlartifacts, the copied one renamed, with one line."""
    import hashlib

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    _db(original)
    monkeypatch.chdir(original)
    (original / "note.txt").write_text("from the original")
    first = tracking.Publisher("amp-validation").publish("k-original", _spec("parent", artifacts=[(original / "note.txt", "")]),
                                                         [])
    shutil.copytree(original, copy, symlinks=True)  # what `cp -a` does
    monkeypatch.chdir(copy)
    def state() -> tuple:
        return hashlib.sha256((copy / "mlflow.db").read_bytes()).hexdigest(), sorted((copy / "mlartifacts").rglob("*"))

    before = state()
    publisher = tracking.Publisher("amp-validation")
    again = publisher.publish("k-original", _spec("parent"), [], remember=False)
    assert (again.run_id, again.created) == (first.run_id, 0)
    assert state() == before
    assert "copied" not in capsys.readouterr().err

    (copy / "note.txt").write_text("from the copy")
    published = publisher.publish("k-copy", _spec("parent", artifacts=[(copy / "note.txt", "")]), [])
    assert published.created == 1 and published.experiment_id != first.experiment_id
    assert publisher.client.get_experiment(published.experiment_id).artifact_location == (copy / "mlartifacts").as_uri()
    new = set((copy / "mlartifacts").rglob("note.txt")) - set(before[1])
    assert [p.read_text() for p in new] == ["from the copy"]
    assert [p.read_text() for p in (original / "mlartifacts").rglob("note.txt")] == ["from the original"]
    renamed = publisher.client.get_experiment(first.experiment_id)
    assert renamed.name == f"amp-validation (copied from {original}, id {first.experiment_id})"
    assert publisher.client.get_run(first.run_id).info.lifecycle_stage == "active"  # the copied runs stay readable
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "was copied from another project" in lines[0] and str(copy / "mlartifacts") in lines[0], lines
    assert tracking.Publisher("amp-validation").publish("k-copy", _spec("parent"), []).run_id == published.run_id


@pytest.fixture
def readonly(tmp_path) -> Iterator[Path]:
    """A folder holding an existing file, that nobody (root included) can write into."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.db").write_bytes(b"")
    if os.geteuid() != 0:
        src.chmod(0o555)
        yield src
        src.chmod(0o755)
        return
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:  # a container without CAP_SYS_ADMIN: the one case where no read-only folder exists
        pytest.skip(f"root without mount permission cannot make a read-only folder: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("uri", ["sqlite:///{ro}/m.db", "sqlite:///{ro}/new.db", "{ro}/mlruns", "file://{ro}/mlruns", "{ro}"])
def test_read_only_tracking_store_fails_fast_naming_the_path(readonly, uri):
    uri = uri.format(ro=readonly)
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        tracking.Publisher("amp-validation", uri=uri)
    took = time.monotonic() - start
    message = str(info.value)
    assert took < 5, f"{took:.1f} s to refuse {uri}"
    assert "\n" not in message
    assert str(readonly) in message and "not writable" in message and "MLFLOW_TRACKING_URI" in message, message
    assert "maintenance mode" not in message and "fix the tracking server" not in message


def test_a_symlinked_artifact_folder_or_database_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A sqlite store's experiments keep their artifacts in the repository's ``mlartifacts`` (and the default database
    is its ``mlflow.db``): either a symlink to elsewhere would have publish write outside the repository. One line
    naming it, before MLflow creates anything; a real folder and file publish as usual."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    monkeypatch.chdir(repo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (repo / "mlartifacts").symlink_to(outside)
    with pytest.raises(UserError) as info:
        tracking.Publisher("amp-validation")
    line = str(info.value)
    assert "\n" not in line and "mlartifacts is a symlink" in line and str(outside) in line, line
    assert not (repo / "mlflow.db").exists() and not any(outside.iterdir())
    (repo / "mlartifacts").unlink()
    shutil.copy(blank_mlflow_db(), outside / "mlflow.db")
    (repo / "mlflow.db").symlink_to(outside / "mlflow.db")
    with pytest.raises(UserError, match="mlflow.db is a symlink"):
        tracking.Publisher("amp-validation")
    (repo / "mlflow.db").unlink()
    assert tracking.Publisher("amp-validation").experiment_id  # a folder and a database of its own: no refusal


def test_plain_path_store_is_refused_with_the_sqlite_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UserError, match=rf"sqlite:///{tmp_path}/mlruns/mlflow.db"):
        tracking.Publisher("amp-validation", uri=str(tmp_path / "mlruns"))


def test_default_uri_is_the_repository_database_also_from_a_temp_copy(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpabc123"
    copy.mkdir(parents=True)
    assert provenance.repository_root(copy) == tmp_path / "repo"
    monkeypatch.chdir(copy)
    assert tracking.tracking_uri() == f"sqlite:///{(tmp_path / 'repo').resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert tracking.tracking_uri() == "http://127.0.0.1:1"


def test_mlflow_keys():
    assert tracking.mlflow_key("acceptance.outputs.*.atol") == "acceptance.outputs.default.atol"
    assert tracking.mlflow_key("values.logits[0].max_abs") == "values.logits_0_.max_abs"
    assert len(tracking.mlflow_key("x" * 400)) == 250
    assert files.flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}


def test_a_sqlite_store_lock_held_too_long_is_one_line(tmp_path, monkeypatch):
    """Publishers of one sqlite database take turns (its creation and migration are not safe to run twice at
    once); one that waited past the limit says who holds the lock instead of a traceback."""
    import sys

    monkeypatch.setattr(tracking, "_LOCK_TIMEOUT_S", 0.5)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, filelock; from pipeline import tracking\n"
         f"lock = tracking._store_lock({uri!r})\nlock.__enter__(); print('held', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(UserError, match=r"another publish to .*mlflow\.db has held its lock"):
            with tracking._store_lock(uri):
                pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()
    lock = tracking._store_lock(uri)
    with lock, lock:  # free again, and re-entrant (a Publisher enters its lock in __init__ and publish)
        pass
