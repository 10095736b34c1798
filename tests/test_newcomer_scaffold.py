"""Issue 51, item 2: ``python scripts/new_model.py PATH`` does the README's three steps for a new model: a module
template outside the repository, the six `deps` lines of dvc.yaml, task.model and task.data in params.yaml (comments
kept); the template then reaches a verdict with the shipped params on the first `dvc repro`."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _project import BIN, ROOT, init_repo
from _project import copy as copy_project
from conftest import blank_mlflow_db

from pipeline.config import load_params

sys.path.insert(0, str(ROOT / "scripts"))
import new_model  # noqa: E402


def scaffold(root: Path, module: Path) -> int:
    return new_model.main([str(module)], root=root)


def test_it_writes_the_template_the_deps_and_the_task_lines_once(tmp_path):
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    module = tmp_path / "home" / "mymodel" / "mymodel.py"
    assert scaffold(tmp_path, module) == 0
    deps = (tmp_path / "dvc.yaml").read_text()
    assert deps.count(f"- {module}") == 6 == deps.count("- pipeline/examples")
    before, after = (ROOT / "params.yaml").read_text().splitlines(), (tmp_path / "params.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after)
    assert [b.strip() for _, b in changed] == ["model: mymodel:build_model", "data: mymodel:load_data"]
    params = load_params(str(tmp_path / "params.yaml"))  # still valid, every other value the shipped one
    assert (params.task.model, params.task.data) == ("mymodel:build_model", "mymodel:load_data")
    assert scaffold(tmp_path, module) == 0 and (tmp_path / "dvc.yaml").read_text() == deps  # once only

    spec = importlib.util.spec_from_file_location("mymodel", module)
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)
    data = template.load_data()
    assert template.build_model()(data["eval_x"]).shape == (len(data["eval_y"]), 4)


def test_an_existing_module_is_never_overwritten_and_mistakes_are_one_line(tmp_path, capsys):
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    mine = tmp_path / "mine.py"
    mine.write_text("# my model\n")
    assert scaffold(tmp_path, mine) == 0 and mine.read_text() == "# my model\n"
    assert scaffold(tmp_path, tmp_path / "my-model.py") == 2
    assert "a Python module name" in capsys.readouterr().err
    assert new_model.main([str(mine)], root=tmp_path / "elsewhere") == 2


@pytest.mark.integration
def test_the_template_reaches_a_verdict_on_the_first_run(tmp_path):
    repo, home = tmp_path / "clone", tmp_path / "home"
    copy_project(repo)
    shutil.copy2(ROOT / "params.yaml", repo / "params.yaml")
    shutil.copy2(blank_mlflow_db(), repo / "mlflow.db")
    init_repo(repo, who="newcomer")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "DVC_EXP_NAME")}
    env |= {"HOME": str(home), "PATH": f"{BIN}:{env.get('PATH', '')}"}
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "new_model.py"), "~/mymodel/mymodel.py"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    export = next(line.strip() for line in made.stdout.splitlines() if line.strip().startswith("export PYTHONPATH="))
    done = subprocess.run(["bash", "-c", f"{export} && dvc repro"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for variant in yaml.safe_load((repo / "params.yaml").read_text())["trial"]["variants"]:
        assert json.loads((repo / f"data/metrics/{variant}.json").read_text())["decision"] in ("accept", "rollback")
