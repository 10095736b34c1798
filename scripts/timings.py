"""Wall times of the main job on this machine, as ratios to `python -c "import torch"` measured in the same run
(so that a fast and a slow machine can be held to the same goals, issue 13):

- a full `dvc repro --force`, with each stage's share (goal: at most 15 import-torch);
- a no-op `dvc repro` (goal: at most 2 s);
- the fixed costs inside the full run: each stage process's imports of torch, torch._dynamo (torch.optim
  imports it at its first step), mlflow and matplotlib (read from a second forced run with
  PYTHONPROFILEIMPORTTIME=1), and dvc's rewrite of dvc.lock after every stage;
- the first run in a fresh copy of the working tree: `make run` (install included), or with --venv the
  steps `make run` takes after the install (git init, dvc repro).

    python scripts/timings.py [--venv PATH] [--threads N]

The copy holds the working tree as it is (tracked and untracked files, not ignored ones), committed in a
new git repository, so uncommitted edits are measured too. Without --venv the copy installs its own
virtual environment, as a newcomer's machine would (that depends on the network).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_REPRO_GOAL = 15.0  # import-torch units
NOOP_GOAL_S = 2.0


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}) in {cwd}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.monotonic() - t0


def staged(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, dict[str, float]]:
    """Run a `dvc repro` and time each stage from its "Running stage" line to the next one."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    stages: dict[str, float] = {}
    current, since = None, t0
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.match(r"Running stage '([^']+)'", line)
        if found:
            now = time.monotonic()
            if current is not None:
                stages[current] = now - since
            current, since = found.group(1), now
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}")
    total = time.monotonic() - t0
    if current is not None:
        stages[current] = t0 + total - since
    return total, stages


# What a full repro pays before any stage computes, per stage process: these modules' import times.
FIXED_IMPORTS = ("torch", "torch._dynamo", "mlflow", "matplotlib.figure")


def import_costs(cmd: list[str], cwd: Path, env: dict[str, str]) -> dict[str, dict[str, float]]:
    """Run a `dvc repro` with PYTHONPROFILEIMPORTTIME=1; per module of FIXED_IMPORTS, seconds per stage importing it.

    Every stage process then reports its imports on stderr, which dvc passes on; each top-level import of a
    module (``torch``, or ``torch._dynamo`` that torch.optim imports at its first step) counts once.
    """
    env = dict(env, PYTHONPROFILEIMPORTTIME="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout[-3000:]}")
    out: dict[str, dict[str, float]] = {name: {} for name in FIXED_IMPORTS}
    stage = None
    for line in proc.stdout.splitlines():  # one stream, in order: dvc's "Running stage" lines, then the stage's imports
        found = re.match(r"Running stage '([^']+)'", line)
        if found:
            stage = found.group(1)
            continue
        timing = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)$", line)
        if stage and timing and timing.group(3) in out:
            out[timing.group(3)][stage] = out[timing.group(3)].get(stage, 0.0) + int(timing.group(1)) / 1e6
    return out


def lock_rewrite(python: str, cwd: Path, env: dict[str, str], repeats: int = 3) -> float:
    """Seconds dvc takes to rewrite dvc.lock (parse and dump, as after every stage it runs): median of 3."""
    code = (
        "import time\nfrom dvc.utils.serialize import modify_yaml\nt = time.perf_counter()\n"
        "with modify_yaml('dvc.lock'):\n    pass\nprint(time.perf_counter() - t)"
    )
    return statistics.median(
        float(subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    )


def copy_worktree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def import_torch(python: str, env: dict[str, str], repeats: int = 3) -> float:
    return statistics.median(timed([python, "-c", "import torch"], ROOT, env) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help="reuse this virtual environment instead of installing one")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every process (default: as set)")
    args = parser.parse_args()
    base_env = dict(os.environ)
    if args.threads:
        base_env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        copy_worktree(clone)
        env = dict(base_env, MLFLOW_TRACKING_URI=f"sqlite:///{clone / 'mlflow.db'}")
        venv_bin = (args.venv.resolve() if args.venv else clone / ".venv") / "bin"
        if args.venv:  # what `make run` does after its install, which would write into the venv given
            env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
            git = ["git", "-c", "user.name=timings", "-c", "user.email=timings@localhost"]
            for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*git, "commit", "-qm", "copy"]):
                timed(cmd, clone, env)
            first = timed([str(venv_bin / "dvc"), "repro"], clone, env)
        else:
            first = timed(["make", "run"], clone, env)
            env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
        torch_s = import_torch(str(venv_bin / "python"), env)
        mlflow_s = timed([str(venv_bin / "python"), "-c", "import mlflow"], ROOT, env)
        force, stages = staged([str(venv_bin / "dvc"), "repro", "--force"], clone, env)
        noop = timed([str(venv_bin / "dvc"), "repro"], clone, env)
        rewrite_s = lock_rewrite(str(venv_bin / "python"), clone, env)
        imports = import_costs([str(venv_bin / "dvc"), "repro", "--force"], clone, env)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}, "
          f"OMP_NUM_THREADS={base_env.get('OMP_NUM_THREADS', 'unset')}")
    print(f"import torch: {torch_s:.2f} s (median of 3; the unit below); import mlflow: {mlflow_s:.2f} s")
    print(f"first run, fresh copy ({'git init + dvc repro, venv reused' if args.venv else 'make run, install included'}): "
          f"{first:.1f} s")
    ratio = force / torch_s
    print(f"dvc repro --force (every stage): {force:.1f} s = {ratio:.1f} x import torch "
          f"(goal <= {FULL_REPRO_GOAL:g}: {'ok' if ratio <= FULL_REPRO_GOAL else 'MISSED'})")
    print(f"dvc repro with nothing to do:    {noop:.2f} s "
          f"(goal <= {NOOP_GOAL_S:g} s: {'ok' if noop <= NOOP_GOAL_S else 'MISSED'})")
    print("per stage (from dvc's 'Running stage' lines, dvc's own hashing included):")
    for name, seconds in stages.items():
        print(f"  {name:<22} {seconds:6.1f} s  {seconds / torch_s:5.1f} x import torch")
    # The floor: what the run pays before any stage computes (a second forced run, with -X importtime).
    print("fixed costs of a full run, before any stage computes:")
    floor = 0.0
    for module, by_stage in imports.items():
        if by_stage:
            floor += sum(by_stage.values())
            print(f"  import {module:<18} in {len(by_stage):2d} stage(s): "
                  f"{sum(by_stage.values()):5.1f} s  ({', '.join(by_stage)})")
    floor += rewrite_s * len(stages)
    print(f"  dvc.lock rewritten after each of {len(stages)} stages: "
          f"{len(stages)} x {rewrite_s:.2f} s = {rewrite_s * len(stages):.1f} s")
    print(f"  together: {floor:.1f} s = {floor / torch_s:.1f} x import torch")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
