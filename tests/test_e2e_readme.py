"""Issue 26: the shell commands of the README and the docs/ pages that run on a CPU machine, run as written.

Each command is read from README.md or a docs/*.md page (an indented block found by its first line, or an inline
`code` span found by its text), not copied here: a README edit that breaks a command breaks its test, and a block that
disappears or is renamed fails with the line it looked for. Commands run through bash with the virtual
environment first on PATH, as after `. .venv/bin/activate`.

- the quick start's `make run` in a fresh copy of the working tree (no .git; dvc.lock and the committed outputs
  included), on an example copied as docs/diagnostics.md says (stress_underflow, the cheapest): one full
  run is both the quick start and the one example run to the end, its diagnosis checked against the lines the
  README quotes; then the `mlflow ui` line, and the Diagnostics line itself (again, and `--dry` for stress_overflow);
- the DVC views (docs/outputs.md, `## With DVC`) and the sweep block (docs/distributed.md, `## Sweeps on DVC's queue`,
  on tests/test_sweep.py's params);
- `python -m pipeline restore --variant NAME` after a rollback (in a copy of the session's `reproduced`);
- `python scripts/timings.py --venv .venv` and `make timings`: checked for the target and the arguments; the real
  run (three full runs of the default pipeline, minutes) only with AMP_README_TIMINGS=1.

tests/test_examples.py runs every example copied verbatim through `dvc repro --dry`; tests/test_newcomer.py follows the
README's "Your model in three steps" and runs its `ls -t mlartifacts/...` and `dvc exp show --drop ...` lines.

Not run: `make test` (this suite), the Docker, GPU, S3 remote and team-server commands (no engine, GPU or
network here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _project import BIN, ROOT, env_for, run
from conftest import TINY, blank_mlflow_db, make_project
from test_e2e_concurrency import experiment_names, parents, wait_for_queue
from test_e2e_sweep import SMALL

pytestmark = pytest.mark.integration

README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}}
"""The guide and the reference pages a command may live in (issue 51 moved most of them out of the README)."""


def blocks(text: str = README) -> list[list[str]]:
    """The README's indented (4-space) code blocks outside ``` fences, each as its lines without the indent."""
    found: list[list[str]] = []
    current: list[str] | None = None
    fenced, blank = False, True
    for line in text.splitlines():
        if line.startswith("```"):
            fenced, current = not fenced, None
        elif not fenced and line.startswith("    ") and (current is not None or blank):
            if current is None:
                current = []
                found.append(current)
            current.append(line[4:])
        else:
            current = None
        blank = not line.strip()
    return found


def block(first: str) -> list[str]:
    """The commands of the one block of the README or a docs/ page whose first line starts with ``first`` (comments and
    blank lines left out)."""
    matches = [b for text in PAGES.values() for b in blocks(text) if b[0].startswith(first)]
    assert len(matches) == 1, (
        f"README.md and docs/*.md: expected one shell block starting with {first!r}, found {len(matches)}; this test runs it"
    )
    return [line for line in matches[0] if line.strip() and not line.lstrip().startswith("#")]


def inline(pattern: str) -> str:
    """The inline `code` span matching ``pattern`` (a regular expression) in the README, else in a docs/ page."""
    found = [m for text in PAGES.values() for m in re.findall(rf"`({pattern})`", text)]
    assert found, f"README.md and docs/*.md no longer mention a command matching {pattern!r}; this test runs it"
    return found[0]


def readme_env(repo: Path) -> dict[str, str]:
    """The test environment (venv first on PATH), with no MLFLOW_TRACKING_URI: publish's default store, the repository's
    mlflow.db."""
    env = env_for(repo)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def sh(repo: Path, command: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    return run(["bash", "-c", command], repo, check=check, env=readme_env(repo), timeout=timeout)


def copy(repo: Path, dest: Path) -> Path:
    shutil.copytree(repo, dest, symlinks=True)
    return dest


def _timings():
    spec = importlib.util.spec_from_file_location("timings", ROOT / "scripts" / "timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stress_line() -> tuple[str, str]:
    """The Diagnostics section's command and the alternative its comment names: (command, "stress_underflow")."""
    (line,) = block("cp examples/stress_overflow.params.yaml")
    command, _, alternative = line.partition("#")
    return command.strip(), alternative.strip().removeprefix("or").strip()


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh copy of the project as a clone has it (no .git; dvc.lock and the committed outputs included), the
    stress_underflow example copied over params.yaml as the Diagnostics section says, then the quick start's
    `make run`: one full pipeline run serves both (a second one, on the defaults, would cost another minute; the
    defaults run in the session's `reproduced`). Read-only for tests: copy it before changing anything."""
    assert block("make run") == ["make run"]
    command, alternative = stress_line()
    repo = tmp_path_factory.mktemp("readme") / "clone"
    _timings().copy_worktree(repo)  # the working tree's tracked and untracked, not ignored, files
    (repo / ".venv").symlink_to(BIN.parent)  # the environment `make run` would have installed, already there
    shutil.copy2(blank_mlflow_db(), repo / "mlflow.db")  # an empty local database (creating one takes ~10 s)
    sh(repo, command.replace("stress_overflow", alternative).split(" && ")[0])  # cp examples/stress_underflow...
    # -o: the install step counts as done, so nothing is ever (re)installed into the test's own environment.
    made = sh(repo, "make -o .venv/.installed run")
    (repo.parent / "make-run.log").write_text(made.stdout + made.stderr)
    run(["git", "branch", "-M", "main"], repo)  # a clone's branch; `git init` here may name it master
    return repo


def test_quick_start_make_run_runs_the_pipeline_and_publishes(clone):
    log = (clone.parent / "make-run.log").read_text()
    assert "Running stage 'freeze'" in log and "publish: " in log, log[-3000:]
    assert "Results: " in log and "mlflow ui --backend-store-uri sqlite:///mlflow.db" in log
    for dtype in ("float16", "bfloat16"):
        assert json.loads((clone / f"data/decision/{dtype}/decision.json").read_text())["decision"] in ("accept", "rollback")
    assert run(["git", "log", "--format=%s"], clone).stdout.split("\n")[0] == "initial import"
    with sqlite3.connect(clone / "mlflow.db") as db:  # the repository's own database: no MLFLOW_TRACKING_URI was set
        (parents,) = db.execute("SELECT count(*) FROM runs WHERE run_uuid NOT IN "
                                "(SELECT run_uuid FROM tags WHERE key = 'mlflow.parentRunId')").fetchone()
    assert parents == 1


def test_stress_example_copied_as_written_runs_end_to_end_and_says_what_the_readme_quotes(clone, tmp_path):
    """The one example run to the end, verbatim: stress_underflow (60 s here, stress_overflow 95 s)."""
    command, alternative = stress_line()
    assert command == "cp examples/stress_overflow.params.yaml params.yaml && dvc repro" and alternative == "stress_underflow"
    assert (clone / "params.yaml").read_bytes() == (ROOT / "examples/stress_underflow.params.yaml").read_bytes()
    fp16 = json.loads((clone / "data/decision/float16/decision.json").read_text())
    assert fp16["decision"] == "accept", fp16["reasons"]  # README: "The trial uses the GradScaler and is accepted"
    quoted = next(b for text in PAGES.values() for b in blocks(text) if b[0].startswith("gradient underflow in float16"))
    expected = " ".join(part.strip() for part in quoted)
    notes = json.loads((clone / "data/diagnose/float16/diagnosis.json").read_text())["notes"]
    assert any(expected in note for note in notes), (expected, notes)

    repo = copy(clone, tmp_path / "repo")
    again = sh(repo, command.replace("stress_overflow", alternative))  # as written: up to date, publish adds nothing
    assert "Running stage 'freeze'" not in again.stdout and "already published" in again.stdout + again.stderr
    dry = sh(repo, f"{command} --dry")  # the line itself (stress_overflow), checked without running: every param there
    assert "Running stage 'publish'" in dry.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quick_start_mlflow_ui_serves_the_published_experiment(clone, tmp_path):
    (command,) = block(".venv/bin/mlflow ui")
    assert "--backend-store-uri sqlite:///mlflow.db" in command
    port = free_port()  # the README's default port 5000 may be taken on a test machine; one worker starts faster than 4
    with open(tmp_path / "ui.log", "w") as log:
        server = subprocess.Popen(["bash", "-c", f"exec {command} --port {port} --workers 1"], cwd=clone, env=readme_env(clone),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=amp-validation"
        deadline, body = time.monotonic() + 120, None
        while body is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    body = json.loads(answer.read())
            except OSError:
                time.sleep(1)
        assert body is not None, (tmp_path / "ui.log").read_text()[-3000:]
        assert body["experiment"]["name"] == "amp-validation"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_sweep_block_runs_as_written(tmp_path):
    """docs/distributed.md's `## Sweeps on DVC's queue`, line by line, on the sweep tests' small params (tests/test_sweep.py)."""
    commands = block("dvc repro freeze && git add -A")
    start = next(i for i, c in enumerate(commands) if c.startswith("dvc queue start"))
    queued = {re.search(r"-n (\S+)", c).group(1) for c in commands[:start] if "--queue" in c}
    assert queued == {"f16", "keep0", "seed1"}
    repo = make_project(tmp_path / "repo", SMALL)
    (repo / "mlflow.db").unlink()  # never published: the two workers create the database at about the same time
    for command in commands[: start + 1]:
        sh(repo, command)
    status = wait_for_queue(repo, readme_env(repo))
    logs = {n: run([str(BIN / "dvc"), "queue", "logs", n], repo, check=False).stdout for n in queued}
    assert "Failed" not in status and status.count("Success") >= len(queued), (status, {n: v[-2000:] for n, v in logs.items()})
    assert queued <= experiment_names(repo)
    assert "Running stage 'freeze'" not in logs["f16"] + logs["keep0"]  # they share the committed reference
    assert "Running stage 'freeze'" in logs["seed1"]
    published = {r.data.tags.get("dvc_experiment") for r in parents(repo / "mlflow.db")}
    # Each experiment of the queue published its own parent run, the database created by two workers at once (before
    # the store lock, one of them died in MLflow's migrations and was lost).
    assert queued <= published, published
    for command in commands[start + 1:]:
        shown = sh(repo, command).stdout
    assert all(n in shown for n in queued), shown
    _dvc_views(repo)


def _dvc_views(repo):
    """docs/outputs.md's `## With DVC`, line by line, in the sweep's repository (its experiments stand for its my-exp)."""
    commands = block("dvc metrics show")
    assert inline(r"dvc exp run -S trial\.variants='\[bfloat16\]'") in commands  # the README's "What to do next" says the same
    run(["git", "branch", "-M", "main"], repo)  # the README's `main`, whatever git's default branch name here
    sh(repo, "dvc exp apply keep0")  # a workspace holding results, as after a `dvc repro` (the sweep ran in the queue)
    before = experiment_names(repo)
    out = {}
    for command in commands:
        if "my-exp" in command:  # the README's placeholder: the experiment the line above it made
            (name,) = experiment_names(repo) - before
            command = command.replace("my-exp", name)
        out[command.split("#")[0].strip()] = sh(repo, command).stdout
    assert "data/metrics/bfloat16.json" in out["dvc metrics show"] and "decision" in out["dvc metrics show"]
    assert "accept" in out["dvc metrics show"] or "rollback" in out["dvc metrics show"]  # the verdict in words
    assert out["dvc metrics diff"] == "" or "data/metrics/" in out["dvc metrics diff"]
    assert (repo / "dvc_plots" / "index.html").is_file()
    shown = next(v for k, v in out.items() if k.startswith("dvc exp show --drop"))
    assert "decision" in shown and "Experiment" in shown
    assert "trial" in out["dvc exp show --only-changed --md"]


def test_restore_after_a_rollback_runs_as_written(reproduced, tmp_path):
    command = inline(r"python -m pipeline restore --variant NAME")
    repo = copy(reproduced, tmp_path / "repo")
    decisions = {
        d: json.loads((repo / f"data/decision/{d}/decision.json").read_text())["decision"] for d in ("float16", "bfloat16")
    }
    rolled = [d for d, v in decisions.items() if v == "rollback"]
    assert rolled, f"TINY's rule rolls bfloat16 back: {decisions} ({TINY['acceptance']})"
    done = sh(repo, command.replace("NAME", rolled[0]))
    assert f"restore {rolled[0]}: verified" in done.stdout
    assert (repo / "restored" / f"reference-{rolled[0]}.safetensors").is_file()


def test_timings_command_is_the_makefile_target_and_parses():
    command = inline(r"python scripts/timings\.py[^`]*")
    assert command == "python scripts/timings.py --venv .venv"
    target = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "timings"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "scripts/timings.py" in target.stdout
    helped = subprocess.run(
        [sys.executable, *command.split()[1:2], "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert helped.returncode == 0 and "--venv" in helped.stdout


@pytest.mark.skipif(
    not os.environ.get("AMP_README_TIMINGS"), reason="three full runs of the default pipeline (minutes): AMP_README_TIMINGS=1"
)
def test_timings_command_runs_as_written():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    command = inline(r"python scripts/timings\.py[^`]*")  # it copies the working tree and runs there
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dvc repro --force (every stage)" in done.stdout and "dvc repro with nothing to do" in done.stdout
