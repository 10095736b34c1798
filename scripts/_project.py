"""One harness for the scripts and the tests: a copy of this project in a folder of its own, and running it there.

A copy holds the project's files as git sees this working tree (tracked and untracked, not ignored; without
git, the same folders less Python's caches), so uncommitted edits run too and this checkout's data/,
dvc.lock and MLflow are never touched. Its params.yaml is a params dict (this checkout's params.yaml, or an
example's) with overrides merged in, by the rule of ``dvc exp run -S``. Sizes and examples are files:
``examples/NAME.params.yaml`` (complete params, scripts/make_examples.py writes them) and
``examples/sizes/NAME.yaml`` (overrides that shrink a run, e.g. to seconds on a CPU).

Which stages run, and how, is dvc.yaml's: ``plan`` expands its ``matrix`` stages over the params, so a run
without dvc (a bare PyTorch image) runs what ``dvc repro`` would, in dvc.yaml's order.

Needs only the standard library, pyyaml and pipeline/config.py (torch-free): gpu_check.py runs it in images that
have nothing else.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a script run from scripts/ without the package installed (gpu_check in an image)
    sys.path.append(str(ROOT))
from pipeline.config import ParamsLoader  # noqa: E402 - YAML 1.2, as the stages and DVC read params (`compile: off`)
BIN = Path(sys.executable).parent
PROJECT = ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore", "pipeline", "examples")
"""What a copy holds: what `dvc repro` reads, the package it runs, and the example params and sizes."""
PLOTS = ".dvc/plots"
"""The plot templates and the offline page `dvc plots show` uses; they go in after `dvc init` makes .dvc/."""


# --- params ---------------------------------------------------------------------------------------------------


def merge(base: dict, override: dict) -> dict:
    """``override`` deep-merged into a copy of ``base``: a mapping merges key by key, anything else replaces."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def params(root: Path = ROOT) -> dict:
    """params.yaml of ``root`` (this checkout by default)."""
    return yaml.load((root / "params.yaml").read_text(), Loader=ParamsLoader)


def example(name: str) -> dict:
    """``examples/NAME.params.yaml``: a complete params.yaml."""
    return yaml.load((ROOT / "examples" / f"{name}.params.yaml").read_text(), Loader=ParamsLoader)


def size(name: str) -> dict:
    """``examples/sizes/NAME.yaml``: overrides that resize a run."""
    return yaml.load((ROOT / "examples" / "sizes" / f"{name}.yaml").read_text(), Loader=ParamsLoader) or {}


def transformer(scale: str) -> dict:
    """The params of the built-in transformer example at ``scale``: ``gpu`` (examples/transformer.params.yaml,
    compute-bound: AMP's gain shows), ``cpu`` or ``tiny`` (that example with examples/sizes/transformer-SCALE.yaml;
    tiny also takes the sizes/tiny.yaml of every tiny run)."""
    out = example("transformer")
    if scale == "tiny":
        out = merge(out, size("tiny"))
    return out if scale == "gpu" else merge(out, size(f"transformer-{scale}"))


def write_params(repo: Path, override: dict) -> None:
    """Merge ``override`` into the params.yaml of ``repo``."""
    (repo / "params.yaml").write_text(yaml.safe_dump(merge(params(repo), override), sort_keys=False))


# --- the copy -------------------------------------------------------------------------------------------------


def project_files(root: Path = ROOT) -> list[str]:
    """The files of ``PROJECT`` under ``root``, relative: git's view of the working tree where git is there."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *PROJECT, PLOTS],
            cwd=root, check=True, capture_output=True,
        ).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout (a copied folder in an image)
        listed = [
            p.relative_to(root).as_posix()
            for top in (*PROJECT, PLOTS)
            for p in ([root / top] if (root / top).is_file() else sorted((root / top).rglob("*")))
            if p.is_file() and "__pycache__" not in p.parts
        ]
    return [name for name in listed if name and (root / name).is_file()]  # a deleted, not yet staged file is gone


def copy(dest: Path, base: dict | None = None, override: dict | None = None, root: Path = ROOT) -> Path:
    """The project at ``root`` in ``dest`` (not a repository yet: ``init_repo``), params.yaml = ``base``
    (default: the project's params.yaml) with ``override`` merged in."""
    dest.mkdir(parents=True, exist_ok=True)
    names = [name for name in project_files(root) if not name.startswith(PLOTS + "/")]
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)
    copy_bytecode(root, dest, names)
    merged = merge(params(root) if base is None else base, override or {})
    (dest / "params.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    return dest


_COMPILED: set[Path] = set()


def copy_bytecode(root: Path, dest: Path, names: list[str]) -> None:
    """This interpreter's compiled modules of the copied sources ``names`` (``pipeline/**/__pycache__``) beside the
    copy's: compiled once per process (compileall: only what is stale) and copied; the sources kept their mtimes
    (``copy2``), which is what Python checks a .pyc against, so every process of the copy loads them instead of
    compiling the package again where PYTHONDONTWRITEBYTECODE is set (a source edited in the copy is compiled afresh).
    .dvcignore keeps them out of DVC's hashes, .gitignore out of git's."""
    import compileall
    import importlib.util

    package = root / "pipeline"
    if sys.pycache_prefix or not package.is_dir():  # bytecode kept elsewhere, by path: nothing to copy
        return
    if package not in _COMPILED:
        compileall.compile_dir(package, quiet=2)
        _COMPILED.add(package)
    for name in names:
        cached = Path(importlib.util.cache_from_source(str(root / name))) if name.endswith(".py") else None
        if cached is not None and cached.is_file():
            (dest / cached.relative_to(root)).parent.mkdir(exist_ok=True)
            shutil.copy2(cached, dest / cached.relative_to(root))


def init_repo(repo: Path, who: str = "test") -> None:
    """Make ``repo`` a git + DVC repository (no analytics, the offline plots page) and commit what is in it.

    DVC's own files come from one real ``dvc init`` and ``dvc config`` per process (``_dvc_template``), copied:
    each dvc command costs seconds of start-up, and tests make dozens of projects."""
    run(["git", "init", "-q"], repo)
    run(["git", "config", "user.email", f"{who}@localhost"], repo)  # the tests commit in it too
    run(["git", "config", "user.name", who], repo)
    template = _dvc_template()
    shutil.copytree(template / ".dvc", repo / ".dvc", dirs_exist_ok=True)
    if not (repo / ".dvcignore").exists():  # the project's own (it keeps bytecode out of directory deps)
        shutil.copy2(template / ".dvcignore", repo / ".dvcignore")
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "copy"], repo)


_TEMPLATE: list[Path] = []


def _dvc_template() -> Path:
    """A folder holding what ``dvc init`` and this harness's ``dvc config`` write (.dvc/, .dvcignore), made once."""
    if not _TEMPLATE:
        import atexit
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="amp-dvc-template-"))
        atexit.register(shutil.rmtree, folder, True)  # one per process that makes projects: none left in /tmp
        run(["git", "init", "-q"], folder)
        run(dvc_cmd("init", "-q"), folder)
        run(dvc_cmd("config", "core.analytics", "false"), folder)
        plots = [name for name in project_files() if name.startswith(PLOTS + "/")]
        for name in plots:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
        if plots:
            run(dvc_cmd("config", "plots.html_template", "plots/offline.html"), folder)
        shutil.rmtree(folder / ".dvc" / "tmp", ignore_errors=True)
        _TEMPLATE.append(folder)
    return _TEMPLATE[0]


# --- running it -----------------------------------------------------------------------------------------------


def env_for(repo: Path, tracking_uri: str | None = None) -> dict[str, str]:
    """The environment a stage of ``repo`` runs in: this interpreter's tools first on PATH, the copy's package
    importable, MLflow at ``tracking_uri`` (default: an sqlite file inside the copy), no DVC experiment name."""
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MLFLOW_TRACKING_URI"] = tracking_uri or f"sqlite:///{repo / 'mlflow.db'}"
    env.pop("DVC_EXP_NAME", None)
    return env


def run(args: list[str], repo: Path, check: bool = True, env: dict | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``args`` in ``repo``, output captured; with ``check``, a failure raises with the output's tail."""
    proc = subprocess.run(args, cwd=repo, env=env or env_for(repo), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tails = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n{tails}")
    return proc


def dvc_cmd(*args: str) -> list[str]:
    """``dvc ARGS``, with the dvc of this interpreter's environment where it has one."""
    return [str(BIN / "dvc") if (BIN / "dvc").exists() else "dvc", *args]


def dvc(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(dvc_cmd(*args), repo, check=check)


def stage(repo: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m pipeline ARGS`` in ``repo``."""
    return run([sys.executable, "-m", "pipeline", *args], repo, check=check)


@dataclass(frozen=True)
class Stage:
    """One stage of dvc.yaml as ``dvc repro`` names and runs it (``trial@float16``)."""

    name: str
    cmd: tuple[str, ...]

    def argv(self) -> list[str]:
        """The command with this interpreter for dvc.yaml's ``python``."""
        return [sys.executable, *self.cmd[1:]] if self.cmd[0] == "python" else list(self.cmd)


def plan(values: dict, root: Path = ROOT) -> list[Stage]:
    """dvc.yaml's stages in its order, each ``matrix`` stage once per combination of its values in ``values``
    (params), named as DVC names them (``NAME@V1-V2``)."""
    out = []
    for name, spec in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].items():
        matrix = {k: _resolve(v, values) for k, v in spec.get("matrix", {}).items()}
        for combo in itertools.product(*matrix.values()) if matrix else [()]:
            item = dict(zip(matrix, combo))
            cmd = re.sub(r"\$\{item\.(\w+)\}", lambda m: str(item[m.group(1)]), spec["cmd"])
            out.append(Stage(f"{name}@{'-'.join(map(str, combo))}" if combo else name, tuple(shlex.split(cmd))))
    return out


def _resolve(value, values: dict):
    """A matrix entry: a list as it is, or ``${a.b}`` looked up in the params."""
    match = re.fullmatch(r"\$\{([\w.]+)\}", value) if isinstance(value, str) else None
    if not match:
        return value
    for part in match.group(1).split("."):
        values = values[part]
    return values
