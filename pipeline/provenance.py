"""Where results come from: the repository, the git commit and what ran beyond it, the DVC experiment, dvc.lock, and
the publish key.

Torch-free and MLflow-free: publish derives its key and checks that the outputs are fresh from these alone,
before it decides whether MLflow needs importing at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# --- what ran, beyond the commit ---------------------------------------------------------------------------------

RUN_OUTPUTS = ("dvc.lock", "data/")
"""What `dvc repro` itself rewrites in the tree (the lock, the stages' outputs): a run's results, not a change of what ran."""
_LISTED = 20
"""Changed files named in a tag; the hash covers every one."""
_FUNCTION = re.compile(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Source:
    """What ran where the commit alone does not say it: uncommitted changes, and code the params name outside the
    repository (a ``module:function`` whose module lives elsewhere on PYTHONPATH)."""

    changed: tuple[str, ...] | None
    """Files that differ from the commit (modified, deleted, untracked), the run's own outputs left out; None outside git."""
    changed_sha256: str
    """sha256 over each changed file's path and bytes ("" when none changed)."""
    outside: tuple[tuple[str, str], ...]
    """(module, file) of each module named by the params that lives outside the repository."""
    outside_sha256: str
    """sha256 over each such module's source files, named relative to their folder on the path (a package: every
    ``.py`` under it), and their bytes ("" when none): the same code gives the same hash on any machine."""

    def tags(self) -> dict[str, str]:
        """The parent run's tags: ``git_dirty`` always (where git answers), the rest where there is something to say."""
        out: dict[str, str] = {}
        if self.changed is not None:
            out["git_dirty"] = "true" if self.changed else "false"
        if self.changed:
            more = f", ... ({len(self.changed)} files)" if len(self.changed) > _LISTED else ""
            listed = ", ".join(self.changed[:_LISTED]) + more
            out |= {"git_dirty_files": listed, "git_dirty_sha256": self.changed_sha256}
        if self.outside:
            out |= {
                "code_outside_repo": ", ".join(f"{m} ({f})" for m, f in self.outside),
                "code_outside_repo_sha256": self.outside_sha256,
            }
        return out

    def line(self) -> str | None:
        """One Markdown line for the parent run's description, or None when the commit says everything."""
        parts = []
        if self.changed:
            names = ", ".join(f"`{n}`" for n in self.changed[:5]) + (", ..." if len(self.changed) > 5 else "")
            parts.append(f"uncommitted changes to {names} (sha256 `{self.changed_sha256[:16]}`)")
        if self.outside:
            modules = ", ".join(f"`{m}` from `{f}`" for m, f in self.outside)
            parts.append(f"code from outside the repository: {modules} (sha256 `{self.outside_sha256[:16]}`)")
        if not parts:
            return None
        return f"**Not the commit alone:** this run used {'; and '.join(parts)}. Tags `git_dirty*`, `code_outside_repo*`."


def source(params: Mapping[str, Any], root: Path | None = None) -> Source:
    """What ran beyond the commit checked out in ``root`` (default: the working folder, as ``git_commit``).

    ``params`` are the flattened params: every value written ``module:function`` names code (task.model, task.data,
    a loss, a metric, an optimizer factory). Modules are found as the stages import them (``sys.path``: the working
    folder, then PYTHONPATH) but not imported: nothing of the user's runs here.
    """
    root = (root or Path.cwd()).resolve()
    changed = _changed_files(root)
    modules = sorted({m.group(1) for v in params.values() if isinstance(v, str) and (m := _FUNCTION.match(v))})
    outside, digest = [], hashlib.sha256()
    for name in modules:
        try:
            found = _module_files(name)
        except (ImportError, ValueError, OSError):  # a name no import could find: the stage said so already
            found = None
        if found is not None and not _inside(found[1][0], repository_root(root)):
            base, files = found
            outside.append((name, str(files[0])))
            digest.update(f"{name}\0{_hash_files(base, [f.relative_to(base) for f in files])}\n".encode())
    return Source(
        changed=None if changed is None else tuple(changed),
        changed_sha256=_hash_files(root, changed or []),
        outside=tuple(outside),
        outside_sha256=digest.hexdigest() if outside else "",
    )


def with_source(spec: Any) -> Any:
    """``spec`` (a ``tracking.RunSpec``, the parent run) with ``source``'s tags, and its line first in the description."""
    found = source(spec.params)
    line = found.line()
    if line is not None:
        print(f"publish: note: {line.replace('**', '').replace('`', '')}")
    note = spec.note if line is None else f"{line}\n\n{spec.note}"
    return dataclasses.replace(spec, tags={**spec.tags, **found.tags()}, note=note)


def _changed_files(root: Path) -> list[str] | None:
    """Paths (relative, sorted) that differ from HEAD, untracked ones included, ``RUN_OUTPUTS`` left out; None outside git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"],
            cwd=root, capture_output=True, timeout=30, check=True,
        ).stdout.decode(errors="surrogateescape")
    except (OSError, subprocess.SubprocessError):
        return None
    paths = {entry[3:] for entry in out.split("\0") if len(entry) > 3}
    return sorted(p for p in paths if not any(p == o or p.startswith(o) for o in RUN_OUTPUTS))


def _module_files(name: str) -> tuple[Path, list[Path]] | None:
    """The folder on the path and the source files of module ``name``, as an import would find them, without
    importing it: the module's own file first, then, for a module inside a package, every ``.py`` of that top-level
    package. None when it cannot be found, or when it is installed (site-packages, the standard library: the
    environment's versions say what those are)."""
    import sysconfig
    from importlib.machinery import PathFinder

    spec, search, top = None, None, None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
        if i == 0 and search:
            top = Path(search[0]).resolve()
    if not spec.origin or not Path(spec.origin).is_file():
        return None
    origin = Path(spec.origin).resolve()
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib")}
    if any(_inside(origin, folder) for folder in installed):
        return None
    if top is None:
        return origin.parent, [origin]
    return top.parent, [origin, *sorted(p for p in top.rglob("*.py") if p != origin)]


def _inside(path: Path, root: Path) -> bool:
    return path == root.resolve() or root.resolve() in path.parents


def _hash_files(base: Path, names: Iterable[str | Path]) -> str:
    """sha256 over each file's name (as given) and bytes ("deleted" for one that is gone); "" for no file."""
    digest, hashed = hashlib.sha256(), False
    for name in names:
        hashed, path = True, base / name
        digest.update(f"{Path(name).as_posix()}\0{sha256_file(path) if path.is_file() else 'deleted'}\n".encode())
    return digest.hexdigest() if hashed else ""
