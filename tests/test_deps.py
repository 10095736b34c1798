"""dvc.yaml's `deps` cover the code each stage runs, computed from the imports (issue 13).

A stage runs ``python -m pipeline STAGE``: ``pipeline/__main__.py``, then ``pipeline/stages/STAGE.py`` and
every ``pipeline.*`` module either imports, transitively, including imports inside functions (the lazy
ones that keep torch out of JSON-only stages). Editing any of them must re-run the stage, so each must be
a dep (the file, or a folder above it). The reverse holds too: a module a stage never imports is not a dep,
since it would re-run the stage for nothing. Pure: no dvc, no torch; part of `make test-fast`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"
# Package markers with no code (a docstring, a version string): not worth a dep in every stage.
EMPTY_INITS = tuple(
    p.relative_to(ROOT).as_posix()
    for p in sorted(PACKAGE.rglob("__init__.py"))
    if all(isinstance(n, (ast.Expr, ast.Assign)) for n in ast.parse(p.read_text()).body)
)
# task.py imports the model and data functions by name ("module:function"), out of the AST's sight: every
# stage that imports it depends on the built-in examples (users add their own model's module likewise).
DYNAMIC = {"pipeline/task.py": "pipeline/examples"}


def module_file(dotted: str) -> Path | None:
    """The file of a ``pipeline.*`` module (a package's ``__init__.py``), or None when it is not one."""
    if dotted != "pipeline" and not dotted.startswith("pipeline."):
        return None
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[Path]:
    """The ``pipeline.*`` files ``path`` imports anywhere in its body (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + ".__init__"
    names: set[str] = set()
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run: annotations only, no dependency
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                base = package.split(".")[: -node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            parts = module.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from pipeline import numerics`
    return {f for n in names if (f := module_file(n)) is not None and f != path}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def closure(start: list[Path]) -> set[Path]:
    seen: set[Path] = set()
    todo = list(start)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(imported_modules(path) - seen)
    return seen


def stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_code(name: str) -> set[str]:
    """Repository-relative files and folders a stage's code depends on."""
    files = closure([PACKAGE / "__main__.py", PACKAGE / "stages" / f"{name}.py"])
    rel = {f.relative_to(ROOT).as_posix() for f in files} - set(EMPTY_INITS)
    return rel | {DYNAMIC[f] for f in rel if f in DYNAMIC}


def covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def code_deps(spec: dict) -> list[str]:
    return [d for d in spec.get("deps", []) if d.startswith("pipeline")]


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_deps_cover_its_import_closure(name: str) -> None:
    spec = stages()[name]
    assert spec["cmd"].split()[:4] == ["python", "-m", "pipeline", name], spec["cmd"]
    deps = code_deps(spec)
    missing = sorted(p for p in stage_code(name) if not covered(p, deps))
    assert not missing, f"dvc.yaml stage {name} runs code it does not list in deps: add {missing}"


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_deps_list_no_code_the_stage_never_runs(name: str) -> None:
    code = stage_code(name)
    stale = [d for d in code_deps(stages()[name]) if not any(covered(p, [d]) for p in code)]
    assert not stale, f"dvc.yaml stage {name} lists code it never imports (re-runs it for nothing): remove {stale}"


def test_the_empty_package_markers_really_are_empty() -> None:
    """The exemption above holds only while they import and define nothing."""
    for rel in EMPTY_INITS:
        body = ast.parse((ROOT / rel).read_text()).body
        assert all(isinstance(n, (ast.Expr, ast.Assign)) for n in body), f"{rel} now holds code: list it in the stages' deps"


def test_closure_follows_lazy_imports_inside_functions(tmp_path: Path) -> None:
    """The closure sees an import written inside a function body (diagnose imports torch-heavy code lazily)."""
    found = {p.relative_to(ROOT).as_posix() for p in imported_modules(PACKAGE / "stages" / "diagnose.py")}
    source = (PACKAGE / "stages" / "diagnose.py").read_text()
    lazy = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef)
        for inner in ast.walk(n)
        if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("pipeline")
    ]
    assert lazy, "diagnose's main imports its heavy modules lazily; this test checks the closure follows them"
    assert any(p.startswith("pipeline/diagnosis") for p in found), found


@pytest.mark.parametrize("name", ["decide", "diagnose"])
def test_json_only_stages_import_neither_torch_nor_mlflow(name: str) -> None:
    """decide reads JSON and writes JSON, and diagnose does on a healthy trial (its replays import torch
    lazily): neither pays torch's nor mlflow's import (seconds each) before it has work that needs them."""
    code = (
        f"import sys; import pipeline.__main__, pipeline.stages.{name}; "
        "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_readme_layout_names_every_module_of_the_package() -> None:
    """The README's map of the house stays the house: every module and sub-package of pipeline/ is on it."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    words = set(re.findall(r"[\w./]+", layout))
    names = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    folders = {f"pipeline/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(n for n in names if n not in words and f"pipeline/{n}" not in words) + sorted(
        f for f in folders if f not in words
    )
    assert not missing, f"README.md's Layout section does not mention {missing}: add a line for each"


DEVICE_CODE = {"pipeline/devices.py", "pipeline/distributed.py", "pipeline/precision.py"}


@pytest.mark.parametrize("name", ["prepare", "decide", "report", "publish"])
def test_stages_that_touch_no_device_do_not_depend_on_device_code(name: str) -> None:
    """A ROCm hint in devices.py, a rank change in distributed.py or an autocast change in precision.py must
    not re-run a stage that never runs on a device: none of the three is in its import closure."""
    reached = sorted(DEVICE_CODE & stage_code(name))
    assert not reached, f"stage {name} imports {reached}; cut the import that pulls it in (pipeline/__main__.py knows no device)"


def test_only_the_stages_that_train_reach_the_torchrun_launcher() -> None:
    reach = sorted(name for name in stages() if "pipeline/launch.py" in stage_code(name))
    assert reach == ["benchmark", "freeze", "trial"], reach


def test_the_import_graph_of_the_package_has_no_circle() -> None:
    """Each module depends on the ones below it only: a circle (devices <-> distributed was one) makes every
    module on it a dep of every stage that reaches any of them."""
    graph = {p: imported_modules(p) for p in PACKAGE.rglob("*.py")}
    done: set[Path] = set()

    def visit(path: Path, trail: list[Path]) -> None:
        if path in trail:
            circle = [p.relative_to(ROOT).as_posix() for p in trail[trail.index(path) :] + [path]]
            raise AssertionError(f"import circle: {' -> '.join(circle)}")
        if path in done:
            return
        for child in graph.get(path, ()):
            visit(child, trail + [path])
        done.add(path)

    for path in sorted(graph):
        visit(path, [])


def test_imports_under_type_checking_are_not_dependencies() -> None:
    """artifacts/decision.py names compare's Stats for annotations only (`if TYPE_CHECKING:`): it never imports them."""
    source = (PACKAGE / "artifacts" / "decision.py").read_text()
    assert "if TYPE_CHECKING:" in source and "pipeline.artifacts.comparison" in source, "the case this test covers is gone"
    assert PACKAGE / "artifacts" / "comparison.py" not in imported_modules(PACKAGE / "artifacts" / "decision.py")
