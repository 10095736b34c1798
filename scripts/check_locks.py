"""Every pinned package of the locks has a distribution for each image's declared Python (asks the package index).

    .venv/bin/python scripts/check_locks.py          (make check-locks; .ci/run runs it before the tests)

For each Python an image declares (``ARG PYTHON=3.x`` in Dockerfile.cuda and Dockerfile.rocm), pip resolves
``requirements.lock`` and ``requirements-dev.lock`` without installing anything (``--dry-run --ignore-installed
--no-deps --python-version 3.x``), and every pinned line must come back in its report. Python 3.10 is the
control: it must fail, on the locks' ``Requires-Python >=3.11``, or the check proves nothing.

``--no-deps`` (the locks are complete) lets pip take ``--python-version`` without ``--only-binary=:all:``, which
the locks cannot pass: antlr4-python3-runtime 4.9.3 (hydra-core, via dvc) is published as an sdist only.
``--ignore-installed`` matters: without it pip accepts what this venv has installed, for any version.

A script, not a test: it talks to the package index, and the tests talk to 127.0.0.1 only. The Pythons
resolve at once (each mostly waits on the index). One line per Python; exit 1 if any is wrong.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile.cuda", "Dockerfile.rocm")
LOCKS = ("requirements.lock", "requirements-dev.lock")
CONTROL = "3.10"
"""A Python the locks exclude: its resolution must fail."""


def declared_python(dockerfile_text: str) -> str:
    """The Python a Dockerfile declares for its base image (``ARG PYTHON=3.12``), which its build checks."""
    found = re.findall(r"^\s*ARG\s+PYTHON=(\S+)\s*$", dockerfile_text, flags=re.MULTILINE | re.IGNORECASE)
    if len(found) != 1:
        raise ValueError(f"declare the base image's Python once (ARG PYTHON=3.x); found {found}")
    return found[0]


def pinned() -> list[str]:
    """The locks' pinned lines."""
    lines = [line for lock in LOCKS for line in (ROOT / lock).read_text().splitlines()]
    return [line for line in lines if line.strip() and not line.startswith("#")]


def resolve(python: str, report: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
           "--python-version", python, "--report", str(report)]
    for lock in LOCKS:
        cmd += ["-r", str(ROOT / lock)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def verdict(python: str, returncode: int, stderr: str, report: Path, expected: int) -> str | None:
    """None when ``python``'s resolution came out as it must, else why not."""
    if python == CONTROL:
        if returncode != 0 and "Requires-Python >=3.11" in stderr:
            return None
        return f"the control {CONTROL} should fail on Requires-Python >=3.11 (exit {returncode}): {stderr[-500:]}"
    if returncode != 0:
        return f"pip could not resolve the locks: {stderr[-1500:]}"
    got = len(json.loads(report.read_text())["install"])
    return None if got == expected else f"pip resolved {got} packages for {expected} pinned lines"


def main() -> int:
    pythons = [CONTROL] + sorted({declared_python((ROOT / f).read_text()) for f in DOCKERFILES})
    expected = len(pinned())
    failed = 0
    with tempfile.TemporaryDirectory(prefix="check-locks-") as tmp:
        reports = {p: Path(tmp) / f"report-{p}.json" for p in pythons}
        running = {p: resolve(p, reports[p]) for p in pythons}
        for python, proc in running.items():
            _, stderr = proc.communicate(timeout=900)
            why = verdict(python, proc.returncode, stderr, reports[python], expected)
            role = "the control, must fail" if python == CONTROL else "an image's Python"
            print(f"check-locks: Python {python} ({role}): {'ok' if why is None else 'FAILED: ' + why}")
            failed += why is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
