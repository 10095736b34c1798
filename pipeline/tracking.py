"""MLflow: the only module that imports it. A mirror of the DVC outputs, never their owner.

Layout: one parent run per pipeline execution, found again by a key (tag ``amp.key``) that the caller
derives from the reference, the code version and the bytes it mirrors; under it, children linked with
the ``mlflow.parentRunId`` tag (each stage ran in a process of its own, so there is no active run to
nest under).

Publishing is all or nothing, idempotent, and safe under concurrency (see ``Publisher``): the parent is
created RUNNING with a heartbeat and set FINISHED only after its last child is complete, so a FINISHED
parent with the key means "already published"; a RUNNING one with a fresh heartbeat is a live publish,
waited for; one with an old heartbeat is what an interrupted publish left, deleted and redone once.
A sqlite store's published trees are also recorded by the project itself (``published``), so that the no-op
publish of every ``dvc repro`` answers without importing MLflow, and without reading MLflow's tables.

The tracking URI is ``MLFLOW_TRACKING_URI`` or, by default, ``sqlite:///<repository root>/mlflow.db``
with an absolute path, so that ``dvc exp run --temp`` writes to the same database as the workspace. An
HTTP server that does not answer, or a store that cannot be written, stops publish within seconds, with
one line; nothing under data/ is ever written here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import sysmetrics
from pipeline.artifacts.record import Record
from pipeline.config import AcceptanceConfig, build
from pipeline.errors import UserError
from pipeline.files import write_bytes
from pipeline.provenance import repository_root

KEY_TAG = "amp.key"
"""Tag of a parent run: which execution it mirrors (the caller's key)."""
MEMBER_TAG = "amp.member_of"
"""Tag of a child run: the key of the execution it belongs to (found again after its parent is gone)."""
HEARTBEAT_TAG = "amp.heartbeat_ms"
"""Tag of a run being published: when its publisher last showed it was alive (ms since the epoch)."""
LEASE_S = 120.0
"""A RUNNING parent with an older heartbeat is an interrupted publish (publishers beat after every upload)."""
WAIT_S = 600.0
"""How long a publisher waits for a live publish of the same key to end before giving up."""
SETTLE_S = 2.0
"""Time for a claim made at the same moment on a server to become visible before claims are ordered."""
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
"""How MLflow 3 types an experiment (model training: it opens on its runs table). MLflow 3.17's UI reads it only where
its GenAI / Model training switch is turned off; otherwise that switch, remembered by the browser, decides."""
_LOCK_TIMEOUT_S = 900.0

# MLflow's limits (mlflow/utils/validation.py): per log_batch call, and on key and value lengths.
_BATCH_PARAMS = 100
_BATCH_METRICS = 1000
_KEY_LENGTH = 250
_PARAM_LENGTH = 6000
_TAG_LENGTH = 8000

_HEALTH_TIMEOUT_S = 5.0
# MLflow's own defaults (7 retries, exponential backoff, 120 s per request) turn a server that dies
# mid-publish into minutes of silence; and it prints a "View run" line per finished run, where publish
# prints one link to the parent. Settings the user exported win.
_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # MLflow 3 reports usage to its vendor unless told not to: publish talks only to the store
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


@dataclass
class ModelSpec:
    """A checkpoint as an MLflow 3 LoggedModel of the run that logs it (the run's Models column, the Models
    tab): its files as the model's artifacts (safetensors; nothing pickled), tags and params a query filters by
    (``mlflow.search_logged_models``), and metrics linked to the model (they are the run's metrics too)."""

    name: str
    files: list[Path]
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSpec:
    """One run as the MLflow UI shows it: a stage variant, or the pipeline execution (the parent)."""

    name: str
    tags: dict[str, str]
    params: dict[str, Any] = field(default_factory=dict)
    """Flat names (see ``flatten``); values that are not strings are shown as JSON."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Single values; entries that are not numbers are ignored, booleans become 0/1."""
    steps: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metric histories: name -> [(step, value)], drawn against the step in the UI."""
    artifacts: list[tuple[Path, str]] = field(default_factory=list)
    """(local file, folder inside the run's artifacts; "" for the top)."""
    texts: dict[str, str] = field(default_factory=dict)
    """Artifact file name -> content, for what exists only in memory (the HTML report)."""
    tables: dict[str, list[dict]] = field(default_factory=dict)
    """Artifact file name (.json) -> rows, logged as an MLflow table."""
    note: str = ""
    """Markdown shown as the run's description."""
    models: list[ModelSpec] = field(default_factory=list)
    """Checkpoints logged as models of this run."""
    system_metrics: list[Path] = field(default_factory=list)
    """Side files of GPU samples (``pipeline.sysmetrics``) of the stages behind this run; absent ones are skipped."""


@dataclass
class Published:
    run_id: str
    """The parent run."""
    created: int
    """Runs created by this call; 0 when the key was already published."""
    uri: str
    experiment_id: str
    removed: int = 0
    """Runs deleted by this call: duplicates and leftovers of concurrent or interrupted publishes."""

    @property
    def link(self) -> str:
        """Where a reviewer lands: the experiment's runs table in model-training mode (MLflow 3 opens in GenAI
        mode otherwise, showing "Traces 0"); for a local database, the command that serves it, then the URL."""
        view = f"#/experiments/{self.experiment_id}/runs?workflowType=machine_learning"
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/{view}"
        return f"`mlflow ui --backend-store-uri {self.uri}`, then open http://127.0.0.1:5000/{view}"

    @property
    def run_link(self) -> str:
        """The parent run's own page (its description holds the verdict), in model-training mode."""
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_id}?workflowType=machine_learning"
        base = self.uri.rstrip("/") if self.uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
        return f"{base}/{page}"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the repository's sqlite database by absolute path."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repository_root() / 'mlflow.db'}"


RECORD_NAME = ".mlflow-published.json"
"""The project's own record of what it published to a sqlite store, in the database's folder (see ``published``):
a ``StoreRecord`` per tracking URI."""


@dataclass(frozen=True)
class PublishedRun(Record):
    run_id: str
    experiment_id: str


@dataclass(frozen=True)
class StoreRecord(Record):
    """What ``RECORD_NAME`` holds for one store: its stamp when written, and the parents published then, by
    experiment name and key."""

    stamp: list[int]
    published: dict[str, dict[str, PublishedRun]]


@dataclass(frozen=True)
class EarlierRule:
    """A rule under which a reference was rolled back in a run published before (``earlier_rollbacks``)."""

    rule: AcceptanceConfig
    rule_sha256: str


def published(uri: str, experiment: str, key: str) -> Published | None:
    """The finished parent of ``key`` as this project recorded it, read without importing MLflow.

    ``publish`` runs at every ``dvc repro`` (it is ``always_changed``); when the default database already holds
    this execution, this answers in milliseconds instead of the seconds that importing MLflow takes. The
    record (``RECORD_NAME``, beside the database, so that it lives and travels with it and stays out of DVC's
    outputs) is written by ``Publisher.publish`` with a stamp of the database file: the sqlite file change
    counter (sqlite's documented file header, not MLflow's tables), inode, size and mtime. Any write to the
    store since (a run deleted in the UI, another publish, a restored backup) changes the stamp, and the caller
    asks MLflow itself, which writes the record again. Only sqlite stores answer here: an HTTP server or
    another database is always asked through MLflow, since nothing checks those without it.
    """
    db = _sqlite_path(uri)
    if db is None:
        return None
    try:
        entry = StoreRecord.from_dict(json.loads((db.parent / RECORD_NAME).read_text())[uri])
        if entry.stamp != _stamp(db):
            return None
        run = entry.published[experiment][key]
        return Published(str(run.run_id), 0, uri, str(run.experiment_id))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _tag(run: Any, name: str) -> str | None:
    """An MLflow run's tag ``name`` (MLflow's own mapping, read here only), None where the run lacks it."""
    return run.data.tags.get(name)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (a query such as ``?timeout=`` left out), else None."""
    return Path(uri[len("sqlite:///") :].split("?")[0]) if uri.startswith("sqlite:///") else None


def _stamp(db: Path) -> list[int]:
    """What changes whenever a sqlite database is written: its file change counter (bytes 24-27 of the header,
    incremented by every committed transaction), inode, size and mtime; a write-ahead log's size and mtime too.

    Raises:
        OSError: the database cannot be read.
    """
    with db.open("rb") as f:
        counter = int.from_bytes(f.read(100)[24:28], "big")
    st = db.stat()
    wal = Path(f"{db}-wal")
    log = [wal.stat().st_size, wal.stat().st_mtime_ns] if wal.is_file() else []
    return [counter, st.st_ino, st.st_size, st.st_mtime_ns, *log]


def check_reachable(uri: str, timeout: float = _HEALTH_TIMEOUT_S) -> None:
    """Fail fast, in one line, when an HTTP tracking server does not answer its /health endpoint.

    Any HTTP answer, even an error status (an authenticating proxy), counts as reachable: the MLflow
    calls that follow report what is wrong with it.

    Raises:
        UserError: connection refused, unknown host, or no answer within ``timeout`` seconds.
    """
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise UserError(
            f"MLflow tracking server {uri} is unreachable ({reason}); the DVC outputs are intact: start the server "
            f"or point MLFLOW_TRACKING_URI at one that runs, then rerun `python -m pipeline publish`"
        ) from None


def mlflow_key(name: str) -> str:
    """A param, metric or tag name MLflow accepts: alphanumerics and ``_-. :/`` only, no path segment that is
    empty, ``.`` or ``..`` (MLflow refuses a name that resolves to another as a path), at most 250 characters.

    The params.yaml wildcard ``*`` (tolerances of every output not listed) reads ``default``; any other
    character MLflow refuses becomes ``_``. A name too long keeps its start and a hash of the rest.
    """
    parts = ["default" if p == "*" else re.sub(r"[^\w\-. :/]", "_", p) for p in name.split(".")]
    key = ".".join(parts).lstrip("/") or "_"
    # MLflow also treats a name as a path that must not resolve to another ("a/../b", "a//b", "./a", "a/"):
    # a segment that is empty, "." or ".." becomes "_" or "__".
    key = "/".join("__" if seg == ".." else "_" if seg in ("", ".") else seg for seg in key.split("/"))
    if len(key) > _KEY_LENGTH:
        key = key[: _KEY_LENGTH - 9] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return key


class Publisher:
    """Publishes one parent run and its children to one experiment, once per key, also under concurrency.

    Several publishers of the same results may run at once (two CI legs, two clones, a parallel DVC
    queue). Each claims the key by creating the parent RUNNING with a heartbeat tag it refreshes after
    every run and artifact; a RUNNING parent whose heartbeat is older than ``lease_s`` is what a killed
    publish left, and is deleted with its children; a fresher one is a live publish, which is waited for.
    Two claims made at the same moment are ordered by (start time, run id) after ``settle_s``: the first
    publishes, the others withdraw. Should two ever both finish (clocks further apart than ``settle_s``),
    the next publish keeps the first and deletes the rest. On a sqlite store, a file lock beside the
    system's temporary files serializes publishers of one database, from its creation on.

    Raises (every method):
        UserError: the server is unreachable or fails midway, the experiment was deleted, or another
            publish of the same key is still running after ``wait_s``.
    """

    def __init__(self, experiment: str, uri: str | None = None, lease_s: float = LEASE_S, wait_s: float = WAIT_S) -> None:
        timeout_exported = "MLFLOW_HTTP_REQUEST_TIMEOUT" in os.environ
        for name, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.uri = uri or tracking_uri()
        self.experiment = experiment
        self.lease_s, self.wait_s = lease_s, wait_s
        _check_store(self.uri)
        self._lock = _store_lock(self.uri)
        self.settle_s = 0.0 if self.uri.startswith("sqlite:") else SETTLE_S  # the lock already orders sqlite publishers
        with self._lock, _failures(self.uri):
            import mlflow

            self.client = mlflow.MlflowClient(tracking_uri=_engine_uri(self.uri))
            if self.uri.startswith(("http://", "https://")) and not timeout_exported:
                self.experiment_id = _first_call(self.uri, lambda: self._experiment(experiment))
            else:
                self.experiment_id = self._experiment(experiment)
            self.copied_from = self._copied_from() if self.uri.startswith("sqlite:///") else None

    def publish(self, key: str, parent: RunSpec, children: list[RunSpec], remember: bool = True) -> Published:
        """Create ``parent`` (tagged with ``key``) and ``children`` under it, unless ``key`` is published.

        The published tree is recorded for ``published`` unless ``remember`` is False (a tree whose publish
        has something to say again each time, such as a rule loosened since a rollback).
        """
        from pipeline.provenance import with_source  # a dirty tree or code outside the repository: said on the parent

        parent = with_source(parent)
        with self._lock, _failures(self.uri):
            done = self._publish(key, parent, children)
            if remember:
                self._remember(key, done)
            return done

    def _publish(self, key: str, parent: RunSpec, children: list[RunSpec]) -> Published:
        """The tree of ``key``: the finished one found, or the one created here (under the lock)."""
        deadline = time.monotonic() + self.wait_s
        waiting = False
        while True:
            parents = self._parents(key)
            done = [r for r in parents if r.info.status == "FINISHED"]
            if done:
                return Published(done[0].info.run_id, 0, self.uri, self.experiment_id, self._dedupe(key, done[0].info.run_id))
            live = []
            for run in parents:
                if run.info.status in ("FAILED", "KILLED") or self._stale(run):
                    self._discard(run.info.run_id)  # a failed or interrupted publish: redone in full below
                else:
                    live.append(run)
            if live:
                if not waiting:
                    waiting = True
                    age = time.time() - _heartbeat(live[0]) / 1000
                    print(
                        f"publish: another publish of these results is running (run {live[0].info.run_id}, heartbeat {age:.0f} s "
                        f"ago); waiting up to {self.wait_s:.0f} s for it to end", file=sys.stderr, flush=True,
                    )
                if time.monotonic() > deadline:
                    age = time.time() - _heartbeat(live[0]) / 1000
                    raise UserError(
                        f"another publish of these results (run {live[0].info.run_id} at {self.uri}) is still running, "
                        f"last heartbeat {age:.0f} s ago; rerun `python -m pipeline publish` once it ends (it then adds nothing)"
                    )
                time.sleep(1.0)
                continue
            if self.copied_from is not None:
                self._leave_copied_experiment()
            parent_id = self._claim(parent, key)
            if parent_id is None:
                continue  # an earlier claim won: wait for it
            created = [parent_id]
            try:
                self._fill(parent_id, parent)
                for spec in children:
                    child = self._start(spec, {"mlflow.parentRunId": parent_id, MEMBER_TAG: key})
                    created.append(child)
                    self._fill(child, spec, heartbeat=parent_id)
                    self.client.set_terminated(child, "FINISHED")
                self.client.set_terminated(parent_id, "FINISHED")
            except BaseException:
                self._mark_failed(created)  # the next publish redoes it at once, without waiting for a lease
                raise
            # Should another tree of this key have finished too (clocks further apart than settle_s), the
            # first claim stays published whoever finishes last, as the already-published branch above says.
            keep = next((r.info.run_id for r in self._parents(key) if r.info.status == "FINISHED"), parent_id)
            created = 1 + len(children) if keep == parent_id else 0
            return Published(keep, created, self.uri, self.experiment_id, self._dedupe(key, keep))

    def _remember(self, key: str, done: Published) -> None:
        """Record ``done`` for ``published`` (sqlite stores only). The stamp is taken BEFORE the run is checked
        through MLflow: a deletion before the stamp is seen by the check, one after it changes the stamp.
        Best effort: an unwritable record only costs the next no-op its MLflow import."""
        db = _sqlite_path(self.uri)
        if db is None:
            return
        try:
            stamp = _stamp(db)
        except OSError:
            return
        run = self.client.get_run(done.run_id)
        if run.info.status != "FINISHED" or run.info.lifecycle_stage != "active":
            return
        if self.client.get_experiment(done.experiment_id).lifecycle_stage != "active":
            return
        record_path = db.parent.resolve() / RECORD_NAME
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        try:
            entry = StoreRecord.from_dict(record.get(self.uri))
        except (ValueError, TypeError, AttributeError):
            entry = None
        if entry is None or entry.stamp != stamp:  # the other entries are stale: dropped
            entry = StoreRecord(stamp=stamp, published={})
        runs = {**entry.published.get(self.experiment, {}), key: PublishedRun(done.run_id, done.experiment_id)}
        record = {**record, self.uri: StoreRecord(stamp, {**entry.published, self.experiment: runs}).as_dict()}
        try:
            write_bytes(record_path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
        except (OSError, UserError):
            return

    def earlier_rollbacks(self, reference_run_key: str, variant: str) -> list[EarlierRule]:
        """Rules under which this reference was rolled back for ``variant`` in runs published before, one per
        distinct rule, in a fixed order.

        Variant runs carry ``rule_json``; so did the ``decide@DTYPE`` runs of earlier versions. Runs are found by
        their ``variant`` tag; runs of versions before named variants carry only ``dtype``, which was the name
        then (a ``dtype`` tag beside a ``variant`` tag is the policy's dtype, shared by other variants: not a
        match). A key this version's rule lacks is filled with its default; a rule with a key it does not know
        (a criterion since removed) cannot be compared and is left out.
        """
        rolled_back = f"tags.decision = 'rollback' AND tags.reference_run_key = '{reference_run_key}'"
        with self._lock, _failures(self.uri):
            runs = self._search(f"tags.variant = '{variant}' AND {rolled_back}")
            runs += [r for r in self._search(f"tags.dtype = '{variant}' AND {rolled_back}") if _tag(r, "variant") is None]
        out, seen = [], set()
        for run in runs:
            rule_json, sha = _tag(run, "rule_json"), _tag(run, "rule_sha256") or ""
            if rule_json and sha not in seen:
                seen.add(sha)
                try:
                    out.append(EarlierRule(build(AcceptanceConfig, json.loads(rule_json), "rule_json"), sha))
                except (UserError, ValueError):
                    continue
        return sorted(out, key=lambda r: r.rule_sha256)

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is None:
            location = None
            if self.uri.startswith("sqlite:"):
                # Beside the database, not under the working folder (a `dvc exp run --temp` copy is deleted).
                location = (repository_root() / "mlartifacts").as_uri()
            try:
                return self.client.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
            except MlflowException as exc:  # another publisher created it a moment ago
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                found = self.client.get_experiment_by_name(name)
        if found.lifecycle_stage == "deleted":
            raise UserError(
                f"MLflow experiment {name!r} at {self.uri} is deleted; restore it (`mlflow experiments restore "
                f"--experiment-id {found.experiment_id}`) or set tracking.experiment in params.yaml to another name"
            )
        if found.tags.get(KIND_TAG) != KIND:  # created by an older version, or typed GenAI by MLflow's UI
            self.client.set_experiment_tag(found.experiment_id, KIND_TAG, KIND)
        return found.experiment_id

    def _copied_from(self) -> Path | None:
        """The other project's ``mlartifacts`` where this database was copied from one (``cp -a`` of a project with
        its mlflow.db): its experiment keeps the ORIGINAL project's artifact location, an absolute path. None when
        the database is not in this repository, or its experiment stores artifacts here."""
        from urllib.parse import unquote, urlparse

        db = Path(self.uri[len("sqlite:///") :].split("?")[0]).resolve()
        root = repository_root().resolve()
        location = self.client.get_experiment(self.experiment_id).artifact_location or ""
        if db.parent != root or not location.startswith("file:"):
            return None
        current = Path(unquote(urlparse(location).path))
        return None if current.name != "mlartifacts" or current == root / "mlartifacts" else current

    def _leave_copied_experiment(self) -> None:
        """Before anything is published from a copied database: MLflow's API cannot move an experiment's artifact
        location, so the copied experiment is renamed (its runs stay readable, their artifacts where they always
        were) and this project publishes into a new one of the same name, storing artifacts in its own
        ``mlartifacts``. A copy whose results were all published already writes nothing: it never gets here."""
        copied = self.client.get_experiment(self.experiment_id)
        label = f"{copied.name} (copied from {self.copied_from.parent}, id {copied.experiment_id})"
        self.client.rename_experiment(copied.experiment_id, label)
        self.experiment_id, self.copied_from = self._experiment(copied.name), None
        print(
            f"publish: {self.uri} was copied from another project, whose artifacts its experiment stores "
            f"({copied.artifact_location}); renamed it {label!r} and publishing into a new {copied.name!r}, with "
            f"artifacts in {repository_root() / 'mlartifacts'}", file=sys.stderr, flush=True,
        )

    def _search(self, query: str) -> list:
        runs, token = [], None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string=query, max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _parents(self, key: str) -> list:
        """Every live parent run of ``key``, first claim first."""
        runs = [r for r in self._search(f"tags.`{KEY_TAG}` = '{key}'") if "mlflow.parentRunId" not in r.data.tags]
        return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def _stale(self, run) -> bool:
        """A RUNNING parent whose publisher stopped refreshing its heartbeat (killed, or its machine lost)."""
        return time.time() * 1000 - _heartbeat(run) > self.lease_s * 1000

    def _claim(self, spec: RunSpec, key: str) -> str | None:
        """Create the parent RUNNING; keep it only if no earlier claim of ``key`` is live or finished."""
        run_id = self._start(spec, {KEY_TAG: key})
        if self.settle_s:
            time.sleep(self.settle_s)  # lets a claim made at the same moment become visible
        rivals = [r for r in self._parents(key) if r.info.status == "FINISHED" or not self._stale(r)]
        if rivals and rivals[0].info.run_id != run_id:
            self.client.delete_run(run_id)
            return None
        return run_id

    def _dedupe(self, key: str, keep: str) -> int:
        """Delete what concurrent or killed publishers of ``key`` left beside the published tree ``keep``:
        other finished parents with their children, and children whose parent is gone. Returns how many."""
        removed = 0
        for run in self._parents(key):
            if run.info.run_id != keep and run.info.status == "FINISHED":
                removed += self._discard(run.info.run_id)
        for child in self._search(f"tags.`{MEMBER_TAG}` = '{key}'"):
            parent = _tag(child, "mlflow.parentRunId")
            if parent != keep and not self._is_live_parent(parent):
                self._delete_run(child.info.run_id)
                removed += 1
        return removed

    def _is_live_parent(self, run_id: str | None) -> bool:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return False
        return run.info.lifecycle_stage == "active" and run.info.status == "RUNNING" and not self._stale(run)

    def _discard(self, run_id: str) -> int:
        """Delete a parent and whatever children it got; returns how many runs were deleted."""
        children = self._search(f"tags.`mlflow.parentRunId` = '{run_id}'")
        for child in children:
            self._delete_run(child.info.run_id)
        self._delete_run(run_id)
        return 1 + len(children)

    def _delete_run(self, run_id: str) -> None:
        """A run and the models it logged (a model outlives its run otherwise, in the Models tab and in queries)."""
        for model in self.client.search_logged_models([self.experiment_id], filter_string=f"source_run_id = '{run_id}'"):
            self.client.delete_logged_model(model.model_id)
        self.client.delete_run(run_id)

    def _mark_failed(self, run_ids: list[str]) -> None:
        """Best effort: a store that is failing may refuse this too (then the lease expires as for a kill)."""
        for run_id in reversed(run_ids):
            try:
                self.client.set_terminated(run_id, "FAILED")
            except Exception:  # noqa: BLE001 - the original failure is the one to report
                return

    def _beat(self, run_id: str) -> None:
        self.client.set_tag(run_id, HEARTBEAT_TAG, str(int(time.time() * 1000)))

    def _start(self, spec: RunSpec, link: dict[str, str]) -> str:
        tags = {**spec.tags, **link, "mlflow.runName": spec.name, HEARTBEAT_TAG: str(int(time.time() * 1000))}
        if spec.note:
            tags["mlflow.note.content"] = spec.note
        tags = {k: str(v)[:_TAG_LENGTH] for k, v in zip(_mlflow_keys(list(tags)), tags.values())}
        return self.client.create_run(self.experiment_id, tags=tags, run_name=spec.name).info.run_id

    def _fill(self, run_id: str, spec: RunSpec, heartbeat: str | None = None) -> None:
        """Log ``spec``'s params, metrics and artifacts, refreshing the parent's heartbeat between uploads."""
        from mlflow.entities import Metric, Param

        beat = heartbeat or run_id
        now = int(time.time() * 1000)
        params = [Param(k, _param_value(v)) for k, v in zip(_mlflow_keys(list(spec.params)), spec.params.values())]
        # Single values and histories share one namespace in MLflow: name them together.
        keys = _mlflow_keys([*spec.metrics, *spec.steps])
        single, series = keys[: len(spec.metrics)], keys[len(spec.metrics) :]
        metrics = [Metric(k, float(v), now, 0) for k, v in zip(single, spec.metrics.values()) if _is_number(v)]
        for k, points in zip(series, spec.steps.values()):
            metrics += [Metric(k, float(v), now, int(s)) for s, v in points if _is_number(v)]
        for chunk in _chunks(params, _BATCH_PARAMS):
            self.client.log_batch(run_id, params=chunk)
        for chunk in _chunks(metrics, _BATCH_METRICS):
            self.client.log_batch(run_id, metrics=chunk)
        for path, folder in spec.artifacts:
            self.client.log_artifact(run_id, str(path), folder or None)
            self._beat(beat)
        for name, text in spec.texts.items():
            self.client.log_text(run_id, text, name)
        for name, rows in spec.tables.items():
            self.client.log_table(run_id, data=_columns(rows), artifact_file=name)
        for model in spec.models:
            self._log_model(run_id, model, now)
            self._beat(beat)
        log_system_metrics(self.client, run_id, spec.system_metrics)
        self._beat(beat)

    def _log_model(self, run_id: str, model: ModelSpec, now: int) -> None:
        """``model`` as a LoggedModel output by ``run_id``, READY once its files and metrics are logged. Its metrics
        carry the run's timestamp: those the run logged already are linked to the model, not logged twice."""
        from mlflow.entities import LoggedModelOutput, Metric

        tags = {k: str(v)[:_TAG_LENGTH] for k, v in zip(_mlflow_keys(list(model.tags)), model.tags.values())}
        params = {k: _param_value(v) for k, v in zip(_mlflow_keys(list(model.params)), model.params.values())}
        logged = self.client.create_logged_model(
            self.experiment_id, name=model.name, source_run_id=run_id, tags=tags, params=params, model_type="safetensors"
        )
        with tempfile.TemporaryDirectory(prefix="amp-model-") as folder:  # the model's files, linked, not copied
            for path in model.files:
                os.symlink(path.resolve(), Path(folder) / path.name)
            self.client.log_model_artifacts(logged.model_id, folder)
        metrics = [
            Metric(k, float(v), now, 0, model_id=logged.model_id)
            for k, v in zip(_mlflow_keys(list(model.metrics)), model.metrics.values()) if _is_number(v)
        ]
        for chunk in _chunks(metrics, _BATCH_METRICS):
            self.client.log_batch(run_id, metrics=chunk)
        self.client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, 0)])
        self.client.finalize_logged_model(logged.model_id, "READY")


def log_system_metrics(client: Any, run_id: str, files: list[Path]) -> int:
    """The GPU samples of ``files`` as the run's system metrics (its System metrics tab), with their wall-clock
    times, and steps counted across the files in time order (a trial's samples, then its benchmark's), as MLflow's
    own monitor numbers them. Returns how many values were logged: 0 where no file exists (a CPU run)."""
    from mlflow.entities import Metric

    samples = sorted((s for f in files for s in sysmetrics.read(f)), key=lambda s: s.timestamp_ms)
    metrics = [Metric(k, v, s.timestamp_ms, step) for step, s in enumerate(samples) for k, v in sorted(s.metrics.items())]
    for chunk in _chunks(metrics, _BATCH_METRICS):
        client.log_batch(run_id, metrics=chunk)
    return len(metrics)


FIRST_CALL_TIMEOUT_S = _HEALTH_TIMEOUT_S
FIRST_CALL_ATTEMPTS = 3


def _first_call(uri: str, call):
    """The first API call to a server, short as the /health probe is: ``FIRST_CALL_ATTEMPTS`` attempts of
    ``FIRST_CALL_TIMEOUT_S`` seconds each, one line per retry. A server that answers /health but hangs on its
    API (a stuck worker, a proxy in front of a dead backend) stops publish in seconds, not minutes of silence.
    The calls after it keep MLflow's longer timeout (artifacts take time).

    Raises:
        UserError: the API did not answer in any attempt.
    """
    import requests
    from mlflow.exceptions import MlflowException

    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")}
    os.environ.update(MLFLOW_HTTP_REQUEST_TIMEOUT=f"{FIRST_CALL_TIMEOUT_S:g}", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    try:
        for attempt in range(1, FIRST_CALL_ATTEMPTS + 1):
            try:
                return call()
            except (MlflowException, requests.exceptions.RequestException) as exc:
                text = str(exc).lower()
                if not isinstance(exc, requests.exceptions.Timeout) and "timed out" not in text and "timeout" not in text:
                    raise
            if attempt < FIRST_CALL_ATTEMPTS:
                print(
                    f"publish: MLflow server {uri} answers /health but its API did not answer within {FIRST_CALL_TIMEOUT_S:g} s "
                    f"(attempt {attempt} of {FIRST_CALL_ATTEMPTS}); retrying", file=sys.stderr, flush=True,
                )
        raise UserError(
            f"MLflow tracking server {uri} answers /health but its API did not answer in {FIRST_CALL_ATTEMPTS} attempts of "
            f"{FIRST_CALL_TIMEOUT_S:g} s; the DVC outputs are intact: restart the server (or its database), then rerun "
            f"`python -m pipeline publish`"
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _heartbeat(run) -> float:
    """Milliseconds since the epoch of a run's last heartbeat (its start, for runs of older versions)."""
    try:
        return float(run.data.tags[HEARTBEAT_TAG])
    except (KeyError, ValueError):
        return float(run.info.start_time or 0)


def _store_lock(uri: str):
    """A lock that serializes the publishers of one sqlite file: MLflow creates and migrates a new database
    without one, so two first publishes at once (a parallel `dvc queue start --jobs 2`) break each other.
    Beside the system's temporary files, not the database: its folder may be a repository that git shows."""
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    import filelock

    db = Path(uri[len("sqlite:///") :]).resolve()
    name = f"amp-mlflow-{hashlib.sha256(str(db).encode()).hexdigest()[:16]}.lock"
    return _StoreLock(filelock.FileLock(str(Path(tempfile.gettempdir()) / name), timeout=_LOCK_TIMEOUT_S), db)


class _StoreLock:
    """filelock's lock (re-entrant: a Publisher enters it in __init__ and in publish), a timeout in one line."""

    def __init__(self, lock, db: Path) -> None:
        self.lock, self.db = lock, db

    def __enter__(self) -> None:
        import filelock

        try:
            self.lock.acquire()
        except filelock.Timeout:
            raise UserError(
                f"another publish to {self.db} has held its lock ({self.lock.lock_file}) for {_LOCK_TIMEOUT_S / 60:.0f} min; "
                f"wait for it to end (or end it), then rerun `python -m pipeline publish`"
            ) from None

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _check_store(uri: str) -> None:
    """Refuse, in one line and within seconds, a tracking URI that cannot work, before anything is created.

    A read-only sqlite path would otherwise have MLflow retry its engine for a minute, and a read-only
    plain path would get MLflow 3's "file store in maintenance mode" message, which names neither the
    folder nor the fix.
    """
    check_reachable(uri)
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        folder = db.parent
        if not folder.is_dir():
            raise UserError(f"MLFLOW_TRACKING_URI {uri}: folder {folder} does not exist; create it or fix the URI")
        _check_writable(folder, db, uri, f"sqlite:///{Path.home() / 'mlflow.db'}")
        _check_not_linked(uri)
        return
    path = _plain_path(uri)
    if path is None:
        return
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None:
        _check_writable(existing if existing.is_dir() else existing.parent, None, uri, f"sqlite:///{Path.home() / 'mlflow.db'}")
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        raise UserError(
            f"MLFLOW_TRACKING_URI {uri} is a folder, and MLflow 3 refuses its file store (maintenance mode); use a "
            f"database instead, e.g. MLFLOW_TRACKING_URI=sqlite:///{path / 'mlflow.db'}, or set MLFLOW_ALLOW_FILE_STORE=true"
        )


def _check_not_linked(uri: str) -> None:
    """No publish writes through a symlink in the repository (docs/reliability-overview.md): the artifact folder a sqlite
    store's experiments are given (``mlartifacts``, ``Publisher._experiment``) and the default database itself.

    Raises:
        UserError: either is a symlink.
    """
    root = repository_root()
    linked = [p for p in (root / "mlartifacts", root / "mlflow.db") if p.is_symlink()]
    if uri != f"sqlite:///{root / 'mlflow.db'}":  # a database the user named elsewhere is theirs to place
        linked = [p for p in linked if p.name == "mlartifacts"]
    if linked:
        raise UserError(
            f"{linked[0]} is a symlink (to {os.readlink(linked[0])}), and publish never writes through one; make it a "
            f"folder or file of its own in the repository (move what it points to back), or set MLFLOW_TRACKING_URI "
            f"to a tracking server"
        )


def _plain_path(uri: str) -> Path | None:
    """The folder of a file-store URI (``/some/mlruns``, ``file:///some/mlruns``), else None."""
    if uri.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    if "://" not in uri and not uri.startswith(("databricks", "sqlite:", "postgresql", "mysql", "mssql")):
        return Path(uri).expanduser().absolute()
    return None


def _check_writable(folder: Path, db: Path | None, uri: str, example: str) -> None:
    """Create (and remove) a file in ``folder`` and open ``db`` for writing: the only test that also holds
    for root, for read-only mounts and for ACLs, where permission bits tell nothing.

    Raises:
        UserError: naming the path that cannot be written and what to do.
    """
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".amp-write-probe-"):
            pass
        if db is not None and db.exists():
            os.close(os.open(db, os.O_RDWR))
    except OSError as exc:
        what = db if db is not None and db.exists() and exc.filename == str(db) else folder
        raise UserError(
            f"MLflow tracking store {what} is not writable ({exc.strerror}); point MLFLOW_TRACKING_URI at a writable "
            f"place (e.g. {example}) or make {what} writable, then rerun `python -m pipeline publish`"
        ) from None


SQLITE_BUSY_S = 30
"""How long a sqlite store locked by another process (a transaction of another writer, an `mlflow ui`
migrating it) is waited for before publish gives up; sqlite's own default is 5 s."""


def _engine_uri(uri: str) -> str:
    """The URI MLflow's engine gets: a sqlite store waits ``SQLITE_BUSY_S`` for a lock (``?timeout=``), unless
    the URI already says how long."""
    if uri.startswith("sqlite:///") and "?" not in uri:
        return f"{uri}?timeout={SQLITE_BUSY_S}"
    return uri


def _locked_line(uri: str) -> str:
    db = uri[len("sqlite:///") :].split("?")[0] if uri.startswith("sqlite:///") else uri
    return (
        f"MLflow store {db} is locked by another process (sqlite: database is locked, waited {SQLITE_BUSY_S} s); the DVC "
        f"outputs are intact: let that process finish (`fuser {db}` names it), then rerun `python -m pipeline publish`"
    )


@contextmanager
def _failures(uri: str) -> Iterator[None]:
    """Turn a tracking store that fails midway into one line; bugs keep their traceback."""
    import requests
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import OperationalError

    try:
        yield
    except OperationalError as exc:
        if "database is locked" in str(exc):
            raise UserError(_locked_line(uri)) from None
        first = (str(exc.orig) if exc.orig is not None else str(exc)).strip().splitlines()[0][:300]
        raise UserError(
            f"the MLflow store {uri} failed ({first}); the DVC outputs are intact: check the database, "
            f"then rerun `python -m pipeline publish`"
        ) from None
    except (MlflowException, requests.exceptions.RequestException, OSError) as exc:
        if "database is locked" in str(exc):
            raise UserError(_locked_line(uri)) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE":
            raise UserError(
                f"MLflow at {uri} refused a name or value of these results ({first}); the DVC outputs are intact and the "
                f"runs of this attempt are marked FAILED: rename what it names (an output, a case id, a params key), then "
                f"rerun `python -m pipeline publish`"
            ) from None
        if "must be in the 'active' state" in str(exc):
            raise UserError(
                f"publishing to {uri} stopped: another publish of the same results took this one for interrupted (no "
                f"heartbeat for {LEASE_S:.0f} s) and removed its runs; rerun `python -m pipeline publish`: it adds nothing "
                f"if the other one finished, and removes any duplicate"
            ) from None
        raise UserError(
            f"publishing to {uri} failed ({first}); the DVC outputs are intact and an interrupted publish is redone "
            f"in full: check the tracking server or MLFLOW_TRACKING_URI, then rerun `python -m pipeline publish`"
        ) from None


def _mlflow_keys(names: list[str]) -> list[str]:
    """``mlflow_key`` of every name, with ``_2``, ``_3``... where two names would collide."""
    seen: set[str] = set()
    out = []
    for name in names:
        key = base = mlflow_key(name)
        n = 1
        while key in seen:
            n += 1
            key = f"{base}_{n}"
        seen.add(key)
        out.append(key)
    return out


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text[:_PARAM_LENGTH]


def _is_number(value: Any) -> bool:
    """Numbers become metrics (booleans as 0/1; NaN and infinities are stored as such)."""
    return isinstance(value, (bool, int, float))


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _columns(rows: list[dict]) -> dict[str, list]:
    """Rows to the column mapping log_table wants: id and kind first, then the other fields sorted."""
    names = {k for r in rows for k in r}
    order = [k for k in ("id", "kind") if k in names] + sorted(names - {"id", "kind"})
    return {k: [_cell(r.get(k)) for r in rows] for k in order}


def _cell(value: Any) -> Any:
    # pandas would turn a column of floats with one None into NaN anyway; keep JSON-safe scalars.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return value
