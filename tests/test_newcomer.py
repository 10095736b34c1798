"""Issue 51: a newcomer follows the README's "Your model in three steps" as written, and gets a verdict on the first run.

Everything is read from README.md, nothing is copied here: the module (the ```python block, written where its first
line says, under a temporary HOME, outside the repository), the params lines (the first ```yaml block, merged into
params.yaml), the `deps` line (the second ```yaml block, added under each `- pipeline/examples` of dvc.yaml), then
the shell block (`export PYTHONPATH=...`, `dvc repro`). The clone is committed first and edited after, as a newcomer
does: the run is from a dirty tree with a model outside the repository, which MLflow must say (issue 51, item 4).
Then the README's "Reading the verdict" lines run as written: the report's path, the `dvc exp show` view.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml
from _project import BIN, ROOT, init_repo, merge
from _project import copy as copy_project
from conftest import blank_mlflow_db

pytestmark = pytest.mark.integration

README = (ROOT / "README.md").read_text()
NOISE = ("Failed to load", "torch/utils/_pytree.py", "is an Enum subclass")
"""Friction 4: third-party lines every stage of a Hugging Face run printed before pipeline/quiet.py."""


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## ``."""
    found = re.search(rf"(?ms)^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README)
    assert found, f"README.md has no section '## {title}'; tests/test_newcomer.py follows it"
    return found.group(1)


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"(?ms)^```{language}\n(.*?)^```", text)


def indented(text: str) -> list[list[str]]:
    """The 4-space indented blocks outside fences, each as its lines without the indent."""
    out: list[list[str]] = []
    current, fence, blank = None, False, True
    for line in text.splitlines():
        if line.startswith("```"):
            fence, current = not fence, None
        elif not fence and line.startswith("    ") and (current is not None or blank):
            if current is None:
                current = []
                out.append(current)
            current.append(line[4:])
        else:
            current = None
        blank = not line.strip()
    return out


def shell(repo: Path, home: Path, command: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """``command`` through bash as a newcomer's shell runs it: the project's environment activated, HOME theirs, no
    PYTHONPATH and no MLFLOW_TRACKING_URI of the test's (publish's default store: the clone's mlflow.db)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "DVC_EXP_NAME")}
    env |= {"HOME": str(home), "PATH": f"{BIN}:{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> dict:
    """The three steps, as written, in a fresh clone; the run's output and paths."""
    steps = section("Your model in three steps")
    root = tmp_path_factory.mktemp("newcomer")
    home, repo = root / "home", root / "clone"
    (code,) = fenced(steps, "python")
    where = re.match(r"# (~/\S+\.py)", code)
    assert where, "the README's module starts with a comment naming its file (# ~/folder/name.py)"
    module = home / where.group(1).removeprefix("~/")
    module.parent.mkdir(parents=True)
    module.write_text(code)

    copy_project(repo)  # the project as a clone has it, with params.yaml's own text (comments included)
    shutil.copy2(ROOT / "params.yaml", repo / "params.yaml")
    shutil.copy2(blank_mlflow_db(), repo / "mlflow.db")
    init_repo(repo, who="newcomer")

    params_lines, deps_lines = fenced(steps, "yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(merge(params, yaml.safe_load(params_lines)), sort_keys=False))
    anchor, added = [line.strip() for line in deps_lines.strip().splitlines()]
    assert anchor == "- pipeline/examples" and added.endswith(module.name), deps_lines
    added = re.sub(r"/home/[^/]+", str(home), added)  # "your module's absolute path"
    dvc_yaml = (repo / "dvc.yaml").read_text()
    stages = re.findall(r"(?m)^( *)- pipeline/examples\b.*$", dvc_yaml)
    assert len(stages) == 6, "the README says six stages list pipeline/examples"
    dvc_yaml = re.sub(r"(?m)^( *)- pipeline/examples\b.*$", lambda m: f"{m.group(0)}\n{m.group(1)}{added}", dvc_yaml)
    (repo / "dvc.yaml").write_text(dvc_yaml)

    (commands,) = [b for b in indented(steps) if b[0].startswith("export PYTHONPATH=")]
    done = shell(repo, home, "\n".join(commands))
    (root / "repro.log").write_text(done.stdout + done.stderr)
    return {"repo": repo, "home": home, "module": module, "done": done, "code": code}


def test_the_readme_module_is_short_and_lives_outside_the_repository(newcomer):
    lines = [line for line in newcomer["code"].splitlines() if line.strip()]
    assert len(lines) <= 20, f"the README's module is {len(lines)} lines: the guide promises about 15"
    assert ROOT not in newcomer["module"].parents and newcomer["repo"] not in newcomer["module"].parents


def test_following_the_readme_reaches_a_verdict_on_the_first_run(newcomer):
    done, repo = newcomer["done"], newcomer["repo"]
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for variant in yaml.safe_load((repo / "params.yaml").read_text())["trial"]["variants"]:
        decision = json.loads((repo / f"data/metrics/{variant}.json").read_text())["decision"]
        assert decision in ("accept", "rollback"), decision
        assert re.search(rf"publish: .*{variant} (ACCEPT|ROLLBACK)", done.stdout), done.stdout[-2000:]
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    building = {name for name, s in stages.items() if any(d["path"] == "pipeline/examples" for d in s.get("deps", []))}
    tracking = {name for name, s in stages.items() if any(d["path"] == str(newcomer["module"]) for d in s.get("deps", []))}
    assert building and tracking == building, "DVC tracks the module wherever the model is built (editing it re-runs them)"


def test_no_third_party_noise_in_the_run(newcomer):
    """Friction 4: torchao's unloadable extensions and torch's pytree deprecation are silenced at their source."""
    out = newcomer["done"].stdout + newcomer["done"].stderr
    noisy = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy[:4]


def test_the_report_is_where_the_readme_says(newcomer):
    """Friction 3: report.html is an MLflow artifact under mlartifacts/, found by the README's own line."""
    (line,) = [b[0] for b in indented(section("Reading the verdict")) if b[0].startswith("ls -t mlartifacts/")]
    found = shell(newcomer["repo"], newcomer["home"], line)
    report = newcomer["repo"] / found.stdout.strip()
    assert found.returncode == 0 and report.is_file(), found
    assert "<html" in report.read_text()[:2000].lower()


def test_the_readme_view_lists_every_verdict(newcomer):
    (line,) = [b[0] for b in indented(section("Reading the verdict")) if b[0].startswith("dvc exp show --drop")]
    shown = shell(newcomer["repo"], newcomer["home"], line)
    assert shown.returncode == 0, shown.stderr
    for variant in ("float16", "bfloat16"):
        assert f"data/metrics/{variant}.json:decision" in shown.stdout.replace("\n", "") or variant in shown.stdout
    assert re.search(r"accept|rollback", shown.stdout), shown.stdout


def test_mlflow_says_what_ran_beyond_the_commit(newcomer):
    """Item 4: the parent run is tagged with the dirty tree and the module outside the repository, with their hashes,
    and its description says so in its first line."""
    with sqlite3.connect(newcomer["repo"] / "mlflow.db") as db:
        rows = db.execute(
            "SELECT key, value FROM tags WHERE run_uuid IN (SELECT run_uuid FROM runs WHERE run_uuid NOT IN "
            "(SELECT run_uuid FROM tags WHERE key = 'mlflow.parentRunId'))"
        ).fetchall()
    tags = dict(rows)
    assert tags["git_dirty"] == "true", tags
    assert set(tags["git_dirty_files"].split(", ")) == {"dvc.yaml", "params.yaml"}, tags["git_dirty_files"]
    assert re.fullmatch(r"[0-9a-f]{64}", tags["git_dirty_sha256"])
    assert str(newcomer["module"]) in tags["code_outside_repo"] and "tinybert" in tags["code_outside_repo"]
    assert re.fullmatch(r"[0-9a-f]{64}", tags["code_outside_repo_sha256"])
    assert tags["mlflow.note.content"].startswith("**Not the commit alone:**"), tags["mlflow.note.content"][:300]
    assert "publish: note: Not the commit alone" in newcomer["done"].stdout
