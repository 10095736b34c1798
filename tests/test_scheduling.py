"""`make test`'s scheduling (tests/conftest.py under pytest-xdist's loadgroup): the tests that share a module-scoped
fixture run on one worker, so that a built project is built once.

pytest 9 keeps a node's id where pytest-xdist 3.8 no longer writes its group suffix (``item._nodeid``): loadgroup then
falls back to per-test units and every module fixture is built on both workers (measured: the variants and two-rank
projects twice each, about 4 min of a clean-clone run). requirements-dev.lock pins pytest 8.4; this test is the alarm
for a lock that moves without the scheduling working."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SHARED = '''
import os, pytest

@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILDS"], "a") as log:
        log.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")

@pytest.mark.parametrize("k", range(6))
def test_uses_it(built, k):
    pass
'''
ALONE = '''
import time

def test_a():
    time.sleep(0.2)

def test_b():
    time.sleep(0.2)
'''


@pytest.mark.integration
def test_a_module_fixture_is_built_on_one_worker_only(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / "tests" / "test_shared.py").write_text(SHARED)
    (tmp_path / "tests" / "test_alone.py").write_text(ALONE)
    builds = tmp_path / "builds.log"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**_env(), "BUILDS": str(builds)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(builds.read_text().splitlines()) == 1, (builds.read_text(), pytest.__version__)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
