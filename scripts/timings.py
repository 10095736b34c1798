"""Print wall times of the main job on this machine: `make run` from a fresh clone, a full
`dvc repro --force`, and a no-op `dvc repro`.

    python scripts/timings.py [--venv PATH]

--venv reuses an existing virtual environment (skips the install, which depends on the network);
without it the fresh clone installs its own, as a newcomer's machine would.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help="reuse this virtual environment instead of installing one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{clone / 'mlflow.db'}")
        make = ["make", "run"] + ([f"VENV={args.venv.resolve()}"] if args.venv else [])
        first = timed(make, clone, env)
        venv_bin = (args.venv.resolve() if args.venv else clone / ".venv") / "bin"
        env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
        force = timed([str(venv_bin / "dvc"), "repro", "--force"], clone, env)
        noop = timed([str(venv_bin / "dvc"), "repro"], clone, env)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}")
    print(f"make run, fresh clone{' (venv reused)' if args.venv else ''}: {first:.1f} s")
    print(f"dvc repro --force (every stage): {force:.1f} s")
    print(f"dvc repro with nothing to do:    {noop:.1f} s")


if __name__ == "__main__":
    main()
