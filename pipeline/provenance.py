"""Where results come from: the repository, the git commit, the DVC experiment, dvc.lock, and the publish key.

Torch-free and MLflow-free: publish derives its key and checks that the outputs are fresh from these alone,
before it decides whether MLflow needs importing at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import yaml

from pipeline import paths
from pipeline.config import DTYPES, ParamsLoader, Yaml12Loader
from pipeline.errors import UserError
from pipeline.files import sha256_file

PER_DTYPE = ("trial", "compare", "diagnose", "decide", "benchmark")
"""The stages that run once per dtype (``STAGE@DTYPE`` in dvc.lock) and whose outputs publish mirrors."""


def repository_root(start: Path | None = None) -> Path:
    """The user's repository, also from inside a ``dvc exp run --temp`` copy (under .dvc/tmp/exps)."""
    here = (start or Path.cwd()).resolve()
    parts = here.parts
    if ".dvc" in parts:
        i = parts.index(".dvc")
        if parts[i + 1 : i + 3] == ("tmp", "exps"):
            return Path(*parts[:i])
    return here


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


def publish_key(reference_run_key: str, rule_sha256: str, commit: str, flat_params: dict, dtypes: list[str]) -> str:
    """The execution's key: the reference, the rule, the commit, the params and the bytes of every mirrored
    file of the configured dtypes (a stale file of another dtype, left after `dvc exp apply`, is no part of it)."""
    return hashlib.sha256(json.dumps({
        "reference": reference_run_key,
        "rule": rule_sha256,
        "commit": commit,
        "params": flat_params,
        "files": {str(p): sha256_file(p) for p in mirrored(dtypes)},
    }, sort_keys=True).encode()).hexdigest()


def mirrored(dtypes: list[str]) -> list[Path]:
    """Every file the runs mirror, in a fixed order; each must exist.

    Raises:
        UserError: a stage output is missing (the pipeline has not run to the end).
    """
    folders = [paths.REFERENCE, paths.REPORT, paths.METRICS]
    folders += [f(d) for d in dtypes for f in (paths.trial, paths.compare, paths.diagnose, paths.decision, paths.benchmark)]
    files: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"{folder} not found; run `dvc repro` first, then publish")
        files += [p for p in folder.rglob("*") if p.is_file() and not _of_another_dtype(p, dtypes)]
    return sorted(set(files))


def _of_another_dtype(path: Path, dtypes: list[str]) -> bool:
    """A report figure or curve, or a metrics file, of a dtype that is not configured now (what an earlier
    configuration left: `data/report/plots/DTYPE/`, `data/report/curves/FAMILY/DTYPE.json`,
    `data/metrics/DTYPE.json`, `data/metrics/bench-DTYPE.json`)."""
    others = set(DTYPES) - set(dtypes)
    return bool(others & set(path.parts[:-1])) or path.stem in others | {f"bench-{d}" for d in others}


def check_fresh(params_path: str, dtypes: list[str]) -> None:
    """Refuse to label results with params they were not produced with (params.yaml edited after `dvc repro`).

    Compares the params each mirrored stage recorded in dvc.lock with params.yaml now. Both files are
    read as the stages read params.yaml (YAML 1.2 numbers, as DVC writes them): params.yaml with
    ``config.ParamsLoader``, dvc.lock (DVC's own writing) with its ``Yaml12Loader``.

    Raises:
        UserError: a param differs: the outputs are stale.
    """
    lock = Path("dvc.lock")
    if Path(params_path).name != "params.yaml" or not lock.is_file():
        return
    current = yaml.load(Path(params_path).read_text(), Loader=ParamsLoader) or {}
    stages = (yaml.load(lock.read_text(), Loader=Yaml12Loader) or {}).get("stages", {})
    checked = {"prepare", "freeze", "report"} | {f"{s}@{d}" for s in PER_DTYPE for d in dtypes}
    for name in sorted(checked & set(stages)):
        for key, recorded in ((stages[name].get("params") or {}).get("params.yaml") or {}).items():
            now = current
            for part in key.split("."):
                now = now.get(part) if isinstance(now, dict) else None
            if now != recorded:
                raise UserError(
                    f"params.yaml {key} changed since stage {name} produced its outputs; run `dvc repro` first so that "
                    f"what is published matches the params it is labelled with"
                )
