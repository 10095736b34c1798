"""Wall times of the main job on this machine, as ratios to `python -c "import torch"` measured in the same run
(so that a fast and a slow machine can be held to the same goals, issue 13):

- a full `dvc repro --force`, with each stage's share (goal: at most 15 import-torch);
- a no-op `dvc repro` (goal: at most 2 s);
- the fixed costs inside the full run: each stage process's imports of torch, torch._dynamo (torch.optim
  imports it at its first step), mlflow and matplotlib (read from the same forced run, under
  PYTHONPROFILEIMPORTTIME=1), and dvc's rewrite of dvc.lock after every stage;
- the first run in a fresh copy of the working tree: `make run` (install included), or with --venv the
  steps `make run` takes after the install (git init, dvc repro);
- the cost of a verdict (issue 23): the necessary trainings (the FP32 reference, its noise replicate, one
  training per variant), read from the lines the stages print (freeze's "freeze seconds:" line, training's
  "LABEL: N steps in S s"), the ratio of the forced run to them, and where the rest goes: imports, dvc.lock
  rewrites, freeze's inference passes, FP64 arbiter and forecast, the trials' other work, the other stages.

    python scripts/timings.py [--venv PATH] [--threads N] [--example NAME] [--size NAME ...] [--verdict-only]

--example runs examples/NAME.params.yaml instead of params.yaml, --size merges examples/sizes/NAME.yaml in
(scripts/_project.py's files); --verdict-only skips the first run and the no-op run (one forced run in all).

The copy holds the working tree as it is (tracked and untracked files, not ignored ones), committed in a
new git repository, so uncommitted edits are measured too. Without --venv the copy installs its own
virtual environment, as a newcomer's machine would (that depends on the network).
"""

# No `from __future__ import annotations`: the dataclasses below must build in a module loaded from its file
# (tests load this script so), where string annotations would look the module up in sys.modules.
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
from dataclasses import dataclass
from pathlib import Path

import yaml

import _project

ROOT = Path(__file__).resolve().parents[1]
FULL_REPRO_GOAL = 15.0  # import-torch units
NOOP_GOAL_S = 2.0


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}) in {cwd}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.monotonic() - t0


# What a full repro pays before any stage computes, per stage process: these modules' import times.
FIXED_IMPORTS = ("torch", "torch._dynamo", "mlflow", "matplotlib.figure")


@dataclass(frozen=True)
class Run:
    """One `dvc repro`, read from its output: each stage's wall time (from its "Running stage" line to the next),
    the lines it printed, and (PYTHONPROFILEIMPORTTIME=1) its imports."""

    total: float
    stages: dict[str, float]
    lines: dict[str, list[str]]
    imports: dict[str, dict[str, float]]
    """Module of FIXED_IMPORTS -> stage -> seconds importing it (each top-level import counts once)."""
    all_imports: dict[str, float]
    """Stage -> seconds of all its top-level imports (whatever the stage imports, pipeline's own modules too)."""


IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)$")


def staged(cmd: list[str], cwd: Path, env: dict[str, str]) -> Run:
    """Run a `dvc repro` with PYTHONPROFILEIMPORTTIME=1 (microseconds per import: it does not move the stage
    times) and read it: every stage process reports its imports on stderr, which dvc passes on in order."""
    env = dict(env, PYTHONPROFILEIMPORTTIME="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    stages: dict[str, float] = {}
    raw: dict[str, list[str]] = {}
    current, since, tail = None, t0, []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-60:]
        found = re.match(r"Running stage '([^']+)'", line)
        if found:
            now = time.monotonic()
            if current is not None:
                stages[current] = now - since
            current, since = found.group(1), now
            raw[current] = []
        elif current is not None:
            raw[current].append(line)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{''.join(tail)}")
    total = time.monotonic() - t0
    if current is not None:
        stages[current] = t0 + total - since
    return of_stages(total, stages, raw)


def of_stages(total: float, stages: dict[str, float], raw: dict[str, list[str]]) -> Run:
    """A ``Run`` from each stage's wall seconds and the lines its process printed under PYTHONPROFILEIMPORTTIME=1:
    the import lines are read into ``imports`` and ``all_imports``, the others kept as the stage's ``lines``."""
    lines: dict[str, list[str]] = {}
    imports: dict[str, dict[str, float]] = {name: {} for name in FIXED_IMPORTS}
    all_imports: dict[str, float] = {}
    for stage, printed in raw.items():
        lines[stage] = []
        for line in printed:
            timing = IMPORT_LINE.match(line.rstrip("\n"))
            if not timing:
                lines[stage].append(line.rstrip("\n"))
                continue
            seconds, nested, module = int(timing.group(1)) / 1e6, timing.group(2), timing.group(3)
            if not nested:  # top level: its cumulative time holds what it imports
                all_imports[stage] = all_imports.get(stage, 0.0) + seconds
            if module in imports:  # printed once per process, where first imported (torch.optim imports torch._dynamo)
                imports[module][stage] = imports[module].get(stage, 0.0) + seconds
    return Run(total, stages, lines, imports, all_imports)


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


FREEZE_LINE = re.compile(r"\s*freeze seconds: (.*)$")
TRAINING_LINE = re.compile(r"(.+): (\d+) steps in ([\d.]+) s$")
"""training.Progress's last line for each training: its label (``trial NAME``, ``freeze FP32``, ...), steps, seconds."""


@dataclass(frozen=True)
class Cost:
    """Where a forced run's time goes: the necessary trainings against everything else, in seconds."""

    total: float
    trainings: dict[str, float]
    """The necessary trainings: ``reference``, ``replicate`` (when on), ``trial NAME`` per variant."""
    rest: dict[str, float]
    """Everything else, by where it goes; with ``trainings`` it adds up to ``total``."""
    missing: tuple[str, ...]
    """Necessary trainings whose time no stage printed (their stage's line is counted in ``rest``)."""

    @property
    def ratio(self) -> float:
        return self.total / sum(self.trainings.values()) if self.trainings else float("inf")


def _family(stage: str) -> str:
    return stage.split("@")[0]


def cost_of_verdict(run: Run, rewrite_s: float) -> Cost:
    """The necessary trainings of ``run`` and where the rest of its time goes (see ``Cost``).

    Per stage, its window (from its "Running stage" line to the next) is its imports, dvc's rewrite of
    dvc.lock, what it printed the time of (freeze's phases, each training's), and the rest: process start,
    loading and verifying inputs, writing and dvc's hashing of outputs, and anything not timed apart.
    """
    trainings: dict[str, float] = {}
    rest: dict[str, float] = {}
    missing: list[str] = []

    def add(key: str, seconds: float) -> None:
        rest[key] = rest.get(key, 0.0) + seconds

    for stage, window in run.stages.items():
        family, known = _family(stage), 0.0
        imports = run.all_imports.get(stage, 0.0)
        add("imports (every stage process)", imports)
        add("dvc.lock rewrites", rewrite_s)
        printed = _printed(run.lines.get(stage, []))
        if family == "freeze":  # the training loops (training.Progress), else freeze's phases, setup included
            phases = printed.freeze
            for label, name, key in (("freeze FP32", "reference training", "reference"),
                                     ("freeze FP32 replicate", "replicate training", "replicate")):
                seconds = phases.pop(name, None)
                if label in printed.trainings or seconds is not None:
                    trainings[key] = printed.trainings.get(label, seconds)
                    known += trainings[key]
            if "reference" not in trainings:
                missing.append("reference")
            for name, seconds in phases.items():
                add(f"freeze: {name}", seconds)
                known += seconds
        elif family == "trial":
            label = f"trial {stage.split('@', 1)[1]}"
            if label in printed.trainings:
                trainings[label] = printed.trainings.pop(label)
                known += trainings[label]
            else:
                missing.append(label)
            for other, seconds in printed.trainings.items():  # the FP32 run aligned on the trial's skipped updates
                add(f"trial: {other.removeprefix(label).strip()}", seconds)
                known += seconds
        add(f"{family}: the rest" if family in ("freeze", "trial") else family, window - imports - rewrite_s - known)
    add("dvc, outside the stages", run.total - sum(run.stages.values()))
    return Cost(run.total, trainings, rest, tuple(missing))


@dataclass(frozen=True)
class Printed:
    freeze: dict[str, float]
    trainings: dict[str, float]


def _printed(lines: list[str]) -> Printed:
    """The times one stage printed: freeze's phases and each training's."""
    freeze: dict[str, float] = {}
    trainings: dict[str, float] = {}
    for line in lines:
        text = line.rsplit("\r", 1)[-1].replace("\x1b[K", "").strip()
        if found := FREEZE_LINE.match(text):
            for part in found.group(1).split(", "):
                name, _, seconds = part.rpartition(" ")
                freeze[name] = float(seconds)
        elif found := TRAINING_LINE.match(text):
            trainings[found.group(1)] = trainings.get(found.group(1), 0.0) + float(found.group(3))
    return Printed(freeze, trainings)


def print_cost(cost: Cost, what: str = "dvc repro --force") -> None:
    necessary = sum(cost.trainings.values())
    print(f"cost of a verdict: {what} {cost.total:.1f} s against {necessary:.1f} s of necessary training: "
          f"ratio {cost.ratio:.2f} (goal on a real-sized model: <= 1.1)")
    for name, seconds in cost.trainings.items():
        print(f"  training {name:<36} {seconds:7.1f} s")
    if cost.missing:
        print(f"  (no time printed for {', '.join(cost.missing)}: its stage's time is counted below)")
    print("  the rest, largest first:")
    for name, seconds in sorted(cost.rest.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<45} {seconds:7.1f} s  {seconds / cost.total:6.1%}")


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
    parser.add_argument("--example", help="run examples/NAME.params.yaml instead of params.yaml")
    parser.add_argument("--size", action="append", default=[], help="merge examples/sizes/NAME.yaml in (repeatable)")
    parser.add_argument("--verdict-only", action="store_true", help="one forced run: the cost of a verdict and the stages")
    args = parser.parse_args()
    if args.verdict_only and not args.venv:
        parser.error("--verdict-only needs --venv (it makes no fresh install)")
    base_env = dict(os.environ)
    if args.threads:
        base_env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        copy_worktree(clone)
        if args.example or args.size:
            values = _project.example(args.example) if args.example else _project.params(clone)
            for name in args.size:
                values = _project.merge(values, _project.size(name))
            (clone / "params.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
        env = dict(base_env, MLFLOW_TRACKING_URI=f"sqlite:///{clone / 'mlflow.db'}")
        venv_bin = (args.venv.resolve() if args.venv else clone / ".venv") / "bin"
        first = None
        if args.venv:  # what `make run` does after its install, which would write into the venv given
            env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
            git = ["git", "-c", "user.name=timings", "-c", "user.email=timings@localhost"]
            for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*git, "commit", "-qm", "copy"]):
                timed(cmd, clone, env)
            if not args.verdict_only:
                first = timed([str(venv_bin / "dvc"), "repro"], clone, env)
        else:
            first = timed(["make", "run"], clone, env)
            env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
        torch_s = import_torch(str(venv_bin / "python"), env)
        mlflow_s = timed([str(venv_bin / "python"), "-c", "import mlflow"], ROOT, env)
        run = staged([str(venv_bin / "dvc"), "repro", "--force"], clone, env)
        noop = None if args.verdict_only else timed([str(venv_bin / "dvc"), "repro"], clone, env)
        rewrite_s = lock_rewrite(str(venv_bin / "python"), clone, env)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}, "
          f"OMP_NUM_THREADS={base_env.get('OMP_NUM_THREADS', 'unset')}; "
          f"params: {args.example or 'params.yaml'}{''.join(f' + sizes/{n}' for n in args.size)}")
    print(f"import torch: {torch_s:.2f} s (median of 3; the unit below); import mlflow: {mlflow_s:.2f} s")
    if first is not None:
        print(f"first run, fresh copy ({'git init + dvc repro, venv reused' if args.venv else 'make run, install included'}): "
              f"{first:.1f} s")
    ratio = run.total / torch_s
    print(f"dvc repro --force (every stage): {run.total:.1f} s = {ratio:.1f} x import torch "
          f"(goal <= {FULL_REPRO_GOAL:g}: {'ok' if ratio <= FULL_REPRO_GOAL else 'MISSED'})")
    if noop is not None:
        print(f"dvc repro with nothing to do:    {noop:.2f} s "
              f"(goal <= {NOOP_GOAL_S:g} s: {'ok' if noop <= NOOP_GOAL_S else 'MISSED'})")
    print("per stage (from dvc's 'Running stage' lines, dvc's own hashing included):")
    for name, seconds in run.stages.items():
        print(f"  {name:<22} {seconds:6.1f} s  {seconds / torch_s:5.1f} x import torch")
    print("fixed costs of a full run, before any stage computes:")
    floor = 0.0
    for module, by_stage in run.imports.items():
        if by_stage:
            floor += sum(by_stage.values())
            print(f"  import {module:<18} in {len(by_stage):2d} stage(s): "
                  f"{sum(by_stage.values()):5.1f} s  ({', '.join(by_stage)})")
    floor += rewrite_s * len(run.stages)
    print(f"  dvc.lock rewritten after each of {len(run.stages)} stages: "
          f"{len(run.stages)} x {rewrite_s:.2f} s = {rewrite_s * len(run.stages):.1f} s")
    print(f"  together: {floor:.1f} s = {floor / torch_s:.1f} x import torch")
    print_cost(cost_of_verdict(run, rewrite_s))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
