"""MLflow: the only module that imports it. A mirror of the DVC outputs, never their owner.

Layout: one parent run per pipeline execution, found again by a key (tag ``amp.key``) that the caller
derives from the reference, the code version and the bytes it mirrors; one child run per stage variant,
linked with the ``mlflow.parentRunId`` tag (each stage ran in a process of its own, so there is no
active run to nest under).

Publishing is all or nothing, and idempotent. The parent is created RUNNING and set FINISHED only
after its last child is complete, so a FINISHED parent with the key means "already published" and
nothing is added. A parent with the key that is not FINISHED is what an interrupted publish left: it
and its children are deleted and everything is published again, once.

The tracking URI is ``MLFLOW_TRACKING_URI`` or, by default, ``sqlite:///<repository root>/mlflow.db``
with an absolute path, so that ``dvc exp run --temp`` writes to the same database as the workspace. An
HTTP server that does not answer stops publish within seconds, with one line; nothing under data/ is
ever written here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

KEY_TAG = "amp.key"

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
}


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


@dataclass
class Published:
    run_id: str
    """The parent run."""
    created: int
    """Runs created by this call; 0 when the key was already published."""
    uri: str
    experiment_id: str

    @property
    def link(self) -> str:
        """Where a reviewer opens the parent run: a URL for a server, else the `mlflow ui` command."""
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"mlflow ui --backend-store-uri {self.uri}  (run {self.run_id})"


def repository_root(start: Path | None = None) -> Path:
    """The user's repository, also from inside a ``dvc exp run --temp`` copy (under .dvc/tmp/exps)."""
    here = (start or Path.cwd()).resolve()
    parts = here.parts
    if ".dvc" in parts:
        i = parts.index(".dvc")
        if parts[i + 1 : i + 3] == ("tmp", "exps"):
            return Path(*parts[:i])
    return here


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the repository's sqlite database by absolute path."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repository_root() / 'mlflow.db'}"


def git_commit() -> str:
    """The commit checked out here ("unknown" outside git or before the first commit)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dvc_experiment_name() -> str | None:
    """Name of the DVC experiment being run, when there is one (``dvc exp run`` sets DVC_EXP_NAME)."""
    return os.environ.get("DVC_EXP_NAME") or None


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


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted names: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty mapping stays a value."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def mlflow_key(name: str) -> str:
    """A param or metric name MLflow accepts: alphanumerics and ``_-. :/`` only, at most 250 characters.

    The params.yaml wildcard ``*`` (tolerances of every output not listed) reads ``default``; any other
    character MLflow refuses becomes ``_``. A name too long keeps its start and a hash of the rest.
    """
    parts = ["default" if p == "*" else re.sub(r"[^\w\-. :/]", "_", p) for p in name.split(".")]
    key = ".".join(parts).lstrip("/") or "_"
    if len(key) > _KEY_LENGTH:
        key = key[: _KEY_LENGTH - 9] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return key


class Publisher:
    """Publishes one parent run and its children to one experiment, once per key.

    Raises (every method):
        UserError: the server is unreachable or fails midway, or the experiment was deleted.
    """

    def __init__(self, experiment: str, uri: str | None = None) -> None:
        for name, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.uri = uri or tracking_uri()
        _check_store(self.uri)
        with _failures(self.uri):
            import mlflow

            self.client = mlflow.MlflowClient(tracking_uri=self.uri)
            self.experiment_id = self._experiment(experiment)

    def publish(self, key: str, parent: RunSpec, children: list[RunSpec]) -> Published:
        """Create ``parent`` (tagged with ``key``) and ``children`` under it, unless ``key`` is published."""
        with _failures(self.uri):
            existing = self._search(f"tags.`{KEY_TAG}` = '{key}'")
            done = [r for r in existing if r.info.status == "FINISHED"]
            if done:
                return Published(done[0].info.run_id, 0, self.uri, self.experiment_id)
            for run in existing:
                self._discard(run.info.run_id)
            parent_id = self._create(parent, {KEY_TAG: key})
            for spec in children:
                self.client.set_terminated(self._create(spec, {"mlflow.parentRunId": parent_id}), "FINISHED")
            self.client.set_terminated(parent_id, "FINISHED")
            return Published(parent_id, 1 + len(children), self.uri, self.experiment_id)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                raise UserError(
                    f"MLflow experiment {name!r} at {self.uri} is deleted; restore it (`mlflow experiments restore "
                    f"--experiment-id {found.experiment_id}`) or set tracking.experiment in params.yaml to another name"
                )
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):
            # Beside the database, not under the working folder (a `dvc exp run --temp` copy is deleted).
            location = (repository_root() / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def _search(self, query: str) -> list:
        runs, token = [], None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string=query, max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _discard(self, run_id: str) -> None:
        """Delete an interrupted publish: the parent and whatever children it got."""
        for child in self._search(f"tags.`mlflow.parentRunId` = '{run_id}'"):
            self.client.delete_run(child.info.run_id)
        self.client.delete_run(run_id)

    def _create(self, spec: RunSpec, link: dict[str, str]) -> str:
        from mlflow.entities import Metric, Param

        tags = {**spec.tags, **link, "mlflow.runName": spec.name}
        if spec.note:
            tags["mlflow.note.content"] = spec.note
        tags = {k: str(v)[:_TAG_LENGTH] for k, v in tags.items()}
        run_id = self.client.create_run(self.experiment_id, tags=tags, run_name=spec.name).info.run_id
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
        for name, text in spec.texts.items():
            self.client.log_text(run_id, text, name)
        for name, rows in spec.tables.items():
            self.client.log_table(run_id, data=_columns(rows), artifact_file=name)
        return run_id


def _check_store(uri: str) -> None:
    """Refuse, in one line, a tracking URI that cannot work before anything is created."""
    check_reachable(uri)
    if uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///") :]).parent
        if not folder.is_dir():
            raise UserError(f"MLFLOW_TRACKING_URI {uri}: folder {folder} does not exist; create it or fix the URI")


@contextmanager
def _failures(uri: str) -> Iterator[None]:
    """Turn a tracking store that fails midway into one line; bugs keep their traceback."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, requests.exceptions.RequestException, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(
            f"publishing to {uri} failed ({first}); the DVC outputs are intact and an interrupted publish is redone "
            f"in full: fix the tracking server, then rerun `python -m pipeline publish`"
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


def earlier_rollbacks(experiment: str, reference_run_key: str, dtype: str) -> tuple[list[dict], str | None]:
    """Rules under which this reference was rolled back for ``dtype`` in earlier published runs.

    Returns the rules (``{"rule": dict, "rule_sha256": str}``) and, when the history could not be read,
    why (the decision records it: an unread history is said, never taken for an empty one). Reads only:
    a missing sqlite database is not created.
    """
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        return [], None  # nothing was ever published here
    for name, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        check_reachable(uri)
        with _failures(uri):
            import mlflow

            client = mlflow.MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(experiment)
            if found is None:
                return [], None
            query = (
                f"tags.stage = 'decide' AND tags.dtype = '{dtype}' AND tags.decision = 'rollback' "
                f"AND tags.reference_run_key = '{reference_run_key}'"
            )
            runs = client.search_runs([found.experiment_id], filter_string=query, max_results=1000)
    except UserError as exc:
        return [], str(exc)
    out, seen = [], set()
    for run in runs:
        rule_json, sha = run.data.tags.get("rule_json"), run.data.tags.get("rule_sha256", "")
        if rule_json and sha not in seen:
            seen.add(sha)
            out.append({"rule": json.loads(rule_json), "rule_sha256": sha})
    return sorted(out, key=lambda r: r["rule_sha256"]), None
