"""Issue 51, item 4: a run made from a dirty tree, or with code outside the repository, says so in MLflow (a tag and a
line on the parent run) with the hash of what ran (pipeline/provenance.py ``source``, applied by ``tracking.Publisher``).

The first tests are pure (a temporary git repository, no MLflow); the last publishes to the real tracking server of
tests/test_tracking.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_tracking import client, server  # noqa: F401 - the real server fixture

from pipeline import provenance, tracking


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path, monkeypatch) -> dict:
    """A committed repository holding a model module, and a user's model module outside it on sys.path."""
    repo, outside = tmp_path / "repo", tmp_path / "home" / "mymodel"
    (repo / "inside").mkdir(parents=True)
    outside.mkdir(parents=True)
    (repo / "inside" / "__init__.py").write_text("")
    (repo / "inside" / "model.py").write_text("def build_model():\n    return None\n")
    (repo / "params.yaml").write_text("seed: 0\n")
    (repo / ".gitignore").write_text("/mlflow.db\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first")
    (outside / "tinymodel.py").write_text("def build_model():\n    return None\n")
    monkeypatch.chdir(repo)
    monkeypatch.syspath_prepend(str(outside))
    monkeypatch.syspath_prepend(str(repo))
    return {"repo": repo, "outside": outside / "tinymodel.py"}


def test_a_clean_tree_with_the_model_inside_says_nothing_more(project):
    found = provenance.source({"task.model": "inside.model:build_model", "task.loss": "cross_entropy", "x": "12:30"})
    assert found.tags() == {"git_dirty": "false"} and found.line() is None


def test_run_outputs_are_not_a_change_of_what_ran(project):
    repo = project["repo"]
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    (repo / "data" / "metrics").mkdir(parents=True)
    (repo / "data" / "metrics" / "float16.json").write_text("{}")
    assert provenance.source({}).changed == () and provenance.source({}).tags() == {"git_dirty": "false"}


def test_a_dirty_tree_is_named_and_hashed(project):
    repo = project["repo"]
    (repo / "params.yaml").write_text("seed: 1\n")
    (repo / "notes.txt").write_text("untracked")
    first = provenance.source({})
    assert first.changed == ("notes.txt", "params.yaml") and first.tags()["git_dirty"] == "true"
    assert first.tags()["git_dirty_files"] == "notes.txt, params.yaml" and len(first.changed_sha256) == 64
    (repo / "params.yaml").write_text("seed: 2\n")
    assert provenance.source({}).changed_sha256 != first.changed_sha256  # the hash is of what ran, not of the names
    assert "uncommitted changes to `notes.txt`, `params.yaml`" in provenance.source({}).line()


def test_code_outside_the_repository_is_named_and_hashed(project):
    params = {"task.model": "tinymodel:build_model", "task.data": "inside.model:build_model", "reference.optimizer": "sgd"}
    found = provenance.source(params)
    assert found.outside == (("tinymodel", str(project["outside"])),)
    assert found.tags()["code_outside_repo"] == f"tinymodel ({project['outside']})"
    before = found.outside_sha256
    project["outside"].write_text("def build_model():\n    return 1\n")
    assert provenance.source(params).outside_sha256 != before
    assert provenance.source({"task.model": "torch.optim:SGD"}).outside == ()  # installed: its version says what it is
    assert provenance.source({"task.model": "no_such_module:f"}).outside == ()


def test_the_parent_run_says_what_ran_beyond_the_commit(project, server):  # noqa: F811 - the fixture
    (project["repo"] / "params.yaml").write_text("seed: 1\n")
    spec = tracking.RunSpec(name="parent", tags={"stage": "pipeline"}, params={"task.model": "tinymodel:build_model"},
                            note="the verdict block")
    published = tracking.Publisher("provenance", uri=server).publish("provenance-key", spec, [])
    run = client(server).get_run(published.run_id)
    tags = run.data.tags
    assert tags["git_dirty"] == "true" and tags["git_dirty_files"] == "params.yaml" and len(tags["git_dirty_sha256"]) == 64
    assert tags["code_outside_repo"] == f"tinymodel ({project['outside']})" and len(tags["code_outside_repo_sha256"]) == 64
    first, _, rest = tags["mlflow.note.content"].partition("\n\n")
    assert first.startswith("**Not the commit alone:**") and "params.yaml" in first and "tinymodel" in first
    assert rest == "the verdict block"
