"""MLflow: the only module that imports it. A mirror of the DVC outputs, never their owner.

Publishing is idempotent: every run carries a key derived from the content it mirrors, and a run whose
key already exists is not created again. The tracking URI is ``MLFLOW_TRACKING_URI`` or, by default,
``sqlite:///<repository root>/mlflow.db`` with an absolute path, so that ``dvc exp run --temp`` writes
to the same database as the workspace.
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

KEY_TAG = "amp.key"


def repository_root(start: Path | None = None) -> Path:
    """The user's repository, also from inside a `dvc exp run --temp` copy (under .dvc/tmp/exps)."""
    here = (start or Path.cwd()).resolve()
    parts = here.parts
    if ".dvc" in parts:
        i = parts.index(".dvc")
        if parts[i + 1 : i + 3] == ("tmp", "exps"):
            return Path(*parts[:i])
    return here


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repository_root() / 'mlflow.db'}"


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """Fail fast, in one line, when an HTTP tracking server does not answer.

    Raises:
        UserError: the server is unreachable.
    """
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(
            f"MLflow tracking server {uri} is unreachable ({reason}); the DVC outputs are intact: start the server "
            f"or set MLFLOW_TRACKING_URI, then rerun `python -m pipeline publish`"
        ) from None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dvc_experiment_name() -> str | None:
    """Name of the DVC experiment being run, when there is one (DVC sets DVC_EXP_NAME)."""
    return os.environ.get("DVC_EXP_NAME")


class Publisher:
    """Creates runs in one experiment, skipping those whose content key already exists."""

    def __init__(self, experiment: str, uri: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        import mlflow

        self.uri = uri or tracking_uri()
        check_reachable(self.uri)
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        if found:
            self.experiment_id = found.experiment_id
        else:
            # Pin artifacts beside the database, not in the working folder (a `dvc exp run --temp` copy).
            location = (repository_root() / "mlartifacts").as_uri() if self.uri.startswith("sqlite:") else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.created = 0
        self.skipped = 0

    def existing(self, key: str) -> str | None:
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def run(
        self,
        key: str,
        name: str,
        tags: dict[str, str],
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        step_metrics: dict[str, list[tuple[int, float]]] | None = None,
        artifacts: list[Path] | None = None,
        parent: str | None = None,
    ) -> str:
        """Create one finished run (or return the existing one with the same key)."""
        from mlflow.entities import Metric, Param, RunTag

        found = self.existing(key)
        if found:
            self.skipped += 1
            return found
        all_tags = {KEY_TAG: key, "mlflow.runName": name, **tags}
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        run_id = run.info.run_id
        batch_metrics = [Metric(k, float(v), 0, 0) for k, v in sorted((metrics or {}).items()) if _number(v)]
        for k, points in sorted((step_metrics or {}).items()):
            batch_metrics += [Metric(k, float(v), 0, int(s)) for s, v in points if _number(v)]
        batch_params = [Param(_key(k), str(v)[:6000]) for k, v in sorted((params or {}).items())]
        for i in range(0, max(len(batch_metrics), len(batch_params), 1), 900):
            self.client.log_batch(run_id, metrics=batch_metrics[i : i + 900], params=batch_params[i : i + 90] if i == 0 else [], tags=[])
        for j in range(90, len(batch_params), 90):
            self.client.log_batch(run_id, params=batch_params[j : j + 90])
        for path in artifacts or []:
            if path.is_file():
                self.client.log_artifact(run_id, str(path))
        self.client.set_terminated(run_id, "FINISHED")
        self.created += 1
        return run_id

    def log_table(self, run_id: str, rows: list[dict], file: str) -> None:
        import mlflow

        columns = sorted({k for r in rows for k in r})
        data = {c: [r.get(c) for r in rows] for c in columns}
        with _active(mlflow, self.uri, run_id):
            mlflow.log_table(data=data, artifact_file=file)


def _key(name: str) -> str:
    """MLflow keys allow alphanumerics and _-. :/ only (``acceptance.outputs.*`` becomes ``..._all_``)."""
    return re.sub(r"[^\w\-. :/]", "_all_" if name.endswith("*") or "*." in name else "_", name)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) or isinstance(v, bool)


class _active:
    """Reopen a finished run by id, for the fluent-only APIs (log_table), then close it again."""

    def __init__(self, mlflow, uri: str, run_id: str) -> None:
        self.mlflow, self.uri, self.run_id = mlflow, uri, run_id

    def __enter__(self):
        self.mlflow.set_tracking_uri(self.uri)
        return self.mlflow.start_run(run_id=self.run_id)

    def __exit__(self, *exc) -> None:
        self.mlflow.end_run()
