"""Shared fixtures: a copy of the project in a temporary git + DVC repository, run with real `dvc repro`.

The copy, the params merge and the runners are scripts/_project.py's (the scripts use the same harness):
tests import them from there (``from _project import run, dvc``); this file adds the tiny size, the blank
MLflow database and the test lanes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# One OpenMP thread for the test process and every stage it starts: no oversubscription on a small
# machine, and the same thread count everywhere (CPU matmul results depend on it, bit for bit).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import _project  # noqa: E402

# examples/sizes/tiny.yaml: a whole `dvc repro` in seconds on 2 CPU cores, the same code paths as the defaults.
# A strict absolute tolerance between FP16's gaps (~6e-4 here) and BF16's (~5e-3, 3 fewer mantissa bits): the
# tiny run then exercises both verdicts, accept (FP16) and rollback (BF16).
TINY = _project.merge(_project.size("tiny"), {"acceptance": {"outputs": {"*": {"atol": 0.002, "rtol": 0.0}}}})


_BLANK_DB: list[Path] = []


def blank_mlflow_db() -> Path:
    """An empty MLflow sqlite database, made once per session (creating the tables imports MLflow, seconds): under
    pytest-xdist, once for all the workers of the run (and the early build of ``reproduced``), by whichever process
    gets there first while the others wait on the lock; else once per process."""
    if not _BLANK_DB:
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run, and their children
        if run_id:
            folder = Path(tempfile.gettempdir()) / f"amp-mlflow-blank-{run_id}"
            folder.mkdir(exist_ok=True)
        else:
            folder = Path(tempfile.mkdtemp(prefix="mlflow-blank-"))
        db, done = folder / "mlflow.db", folder / "done"
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                db.unlink(missing_ok=True)  # what a process that failed midway left
                code = f"import mlflow; mlflow.MlflowClient(tracking_uri='sqlite:///{db}').search_experiments()"
                subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
                done.touch()
        _BLANK_DB.append(db)
    return _BLANK_DB[0]


def import_or_skip(name: str):
    """``pytest.importorskip`` for a package that may also fail otherwise on this torch (torchao 0.18 below torch 2.11
    raises AttributeError at import): skip, naming why."""
    import importlib

    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or the package's own failure on this torch
        pytest.skip(f"{name} does not import here ({type(exc).__name__}: {str(exc)[:120]})", allow_module_level=True)


def make_project(dest: Path, override: dict | None = None) -> Path:
    """Copy the project into ``dest``, make it a git + DVC repository with tiny params, commit."""
    _project.copy(dest, override=_project.merge(TINY, override or {}))
    shutil.copy2(blank_mlflow_db(), dest / "mlflow.db")  # ignored by git, like a user's local database
    _project.init_repo(dest)
    return dest


# --- test lanes ----------------------------------------------------------------------------------------------
# `make test-fast` runs `-m "not integration and not gpu"`. A test is integration when it, or any fixture it
# uses (transitively), copies the project (make_project, or reproduce: then it runs dvc or a stage) or starts a
# server (Popen): marked here from the code itself, so a new test cannot slip into the fast lane by forgetting a mark.
_INTEGRATION_CALLS = {"make_project", "reproduce", "Popen"}


def _runs_the_real_thing(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    funcs = [getattr(item, "function", None)] + [d.func for ds in defs for d in ds]
    return any(_INTEGRATION_CALLS & set(f.__code__.co_names) for f in funcs if hasattr(f, "__code__"))


def _gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not item.get_closest_marker("integration") and _runs_the_real_thing(item):
            item.add_marker(pytest.mark.integration)
    _schedule(items)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _gpu_visible():
        skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU: torch.cuda.is_available() is False here")
        for item in gpu:
            item.add_marker(skip)


# --- scheduling under pytest-xdist ----------------------------------------------------------------------------
# `make test` runs `-n auto --dist loadgroup --no-loadscope-reorder`: each test is a unit of work of its own,
# except that the tests sharing a module-scoped fixture (one built project, one server) form one unit, so that
# one worker builds it once. The units go out in the order set here, longest first: the units that build a
# shared fixture, then the other integration tests, then the unit tests (seconds each), which fill both workers
# at the end instead of one long file running alone on one worker while the other waits.


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("class", "module", "package") for ds in defs for d in ds)


def _schedule(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        if not item.get_closest_marker("integration"):
            return 2
        return 0 if item.get_closest_marker("xdist_group") else 1

    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts the same collection the same way
        items.sort(key=rank)


def _session_root(tmp_path_factory) -> Path:
    """This session's temporary folder, the same in every worker: pytest-of-USER/pytest-N under pytest-xdist."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def reproduce(root: Path) -> Path:
    """``root``/reproduced/repo: one tiny project after a full `dvc repro`, built by whichever process gets here
    first (a worker, or the early build) while any other waits on the lock. What `dvc repro` printed is kept
    beside it (``repro_log``)."""
    repo, done = root / "reproduced" / "repo", root / "reproduced.done"
    with open(root / "reproduced.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(repo.parent, ignore_errors=True)  # what a process that failed midway left
            make_project(repo)
            made = _project.dvc(repo, "repro")
            repro_log(repo).write_text(made.stdout)
            done.touch()
    return repo


def repro_log(reproduced: Path) -> Path:
    """The standard output of the `dvc repro` that built ``reproduced`` (outside the repository)."""
    return reproduced.parent / "repro.log"


@pytest.fixture(scope="session", autouse=True)
def _reproduce_early(request, tmp_path_factory):
    """Start building ``reproduced`` in a process of its own when the session begins, if a selected test needs
    it: its ~15 stage processes then run beside the first tests instead of keeping a worker (and any other
    worker that needs it meanwhile) waiting. One process per session (the first worker); a failed early build
    leaves nothing behind, and the fixture then builds it itself and reports the error."""
    needed = any("reproduced" in item.fixturenames for item in request.session.items)
    if not needed or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        yield
        return
    builder = _start_reproduce(_session_root(tmp_path_factory))
    yield
    if builder.poll() is None:  # the session ended before the build did (-x, a deselected lane)
        os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()


def _start_reproduce(root: Path) -> subprocess.Popen:
    # Not inside _reproduce_early: every test uses that fixture, and a Popen in a fixture marks its tests integration.
    code = "import sys; from pathlib import Path; import conftest; conftest.reproduce(Path(sys.argv[1]))"
    with open(root / "reproduced.early.log", "w") as log:
        return subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=Path(__file__).parent, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory) -> Path:
    """One tiny project after a full `dvc repro` (read-only for tests: copy it before changing anything).

    Built once per session (``reproduce``), in the folder the workers of pytest-xdist share; usually started
    early (``_reproduce_early``)."""
    return reproduce(_session_root(tmp_path_factory))
