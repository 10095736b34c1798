"""Issue 26: every examples/*.params.yaml works as the README says, copied verbatim over params.yaml, then `dvc repro`.

Each example is generated (scripts/make_examples.py, `make examples`): params.yaml deep-merged with
examples/overrides/NAME.yaml. The unit tests here fail when a file differs from what would be generated (a section
added to params.yaml and not yet in the examples) or lacks a params section that dvc.yaml declares; the
integration test copies each file, unmerged, into a reproduced repository and runs `dvc repro --dry` (the check
that said "Parameters 'threads, distributed' are missing"). tests/test_e2e_readme.py runs one example to the end.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys

import pytest
import yaml
from _project import ROOT, run

_spec = importlib.util.spec_from_file_location("make_examples", ROOT / "scripts" / "make_examples.py")
make_examples = importlib.util.module_from_spec(_spec)
sys.modules["make_examples"] = make_examples
_spec.loader.exec_module(make_examples)

EXAMPLES = make_examples.names()


def declared_params() -> set[str]:
    """Every params key (dotted) a stage of dvc.yaml declares; DVC refuses a params.yaml that lacks one."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    keys = set()
    for stage in stages.values():
        for p in stage.get("params", []):
            key = p if isinstance(p, str) else next(iter(p))
            if not key.endswith(".yaml"):
                keys.add(key)
    return keys


def has(params: dict, dotted: str) -> bool:
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_example_is_listed_in_the_readme():
    """The README's list of examples is the shipped one: each overrides file has its generated params file and a name there."""
    listed = re.search(r"Each `examples/NAME\.params\.yaml` \(([^)]*)\)", (ROOT / "README.md").read_text())
    assert listed, "README.md's sentence listing the examples (Each `examples/NAME.params.yaml` (...))"
    names = set(re.findall(r"\b[a-z][a-z0-9_]+\b", listed.group(1)))
    shipped = sorted(p.name.removesuffix(".params.yaml") for p in (ROOT / "examples").glob("*.params.yaml"))
    assert shipped == EXAMPLES, "every examples/NAME.params.yaml is generated from examples/overrides/NAME.yaml"
    assert set(EXAMPLES) <= names, f"README.md does not list {sorted(set(EXAMPLES) - names)}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_is_params_yaml_plus_its_overrides(name):
    """Fails when params.yaml (or the overrides) changed and the examples were not regenerated: `make examples`."""
    shipped = (ROOT / "examples" / f"{name}.params.yaml").read_text()
    assert shipped == make_examples.generate(name), (
        f"examples/{name}.params.yaml differs from params.yaml + examples/overrides/{name}.yaml: run `make examples`"
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_holds_every_param_dvc_yaml_declares(name):
    params = yaml.safe_load((ROOT / "examples" / f"{name}.params.yaml").read_text())
    variants = params["trial"]["variants"]  # a matrix stage declares its variant's own key: one per variant
    keys = {k.replace("${item.variant}", v) for k in declared_params() for v in variants}
    missing = sorted(k for k in keys if not has(params, k))
    assert not missing, f"examples/{name}.params.yaml lacks {missing}: dvc repro would refuse it"


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_says_how_to_run_it(name):
    text = (ROOT / "examples" / f"{name}.params.yaml").read_text()
    assert f"cp examples/{name}.params.yaml params.yaml && dvc repro" in text.split("\nseed:")[0]


def test_overrides_win_keep_their_comments_and_every_other_knob_is_params_yaml():
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    diabetes = yaml.safe_load((ROOT / "examples/diabetes.params.yaml").read_text())
    assert diabetes["task"]["kind"] == "regression" and diabetes["acceptance"]["outputs"]["*"]["atol"] == 0.02
    assert diabetes["compare"] == base["compare"] and diabetes["distributed"] == base["distributed"]
    text = (ROOT / "examples/diabetes.params.yaml").read_text()
    assert '"*": {atol: 0.02, rtol: 0.02}   # in standard deviations of the target' in text
    assert "# Every knob of the pipeline." in text  # params.yaml's own comments come along


def test_a_key_or_section_added_to_params_yaml_reaches_every_example(tmp_path):
    """What happens when someone adds an acceptance key or a new section: regenerated, every example has it."""
    shutil.copytree(ROOT / "examples" / "overrides", tmp_path / "examples" / "overrides")
    text = (ROOT / "params.yaml").read_text()
    text = text.replace("\nacceptance:\n", "\nacceptance:\n  brand_new_knob: 7               # a new rule key\n", 1)
    (tmp_path / "params.yaml").write_text(text + "\nnew_section:        # added later\n  knob: true\n")
    assert make_examples.main(["--check"], root=tmp_path) == 1  # nothing generated yet: every file is stale
    assert make_examples.main([], root=tmp_path) == 0
    assert make_examples.main(["--check"], root=tmp_path) == 0
    for name in EXAMPLES:
        written = (tmp_path / "examples" / f"{name}.params.yaml").read_text()
        params = yaml.safe_load(written)
        assert params["acceptance"]["brand_new_knob"] == 7 and params["new_section"] == {"knob": True}, name
        assert "brand_new_knob: 7               # a new rule key" in written
    lm = yaml.safe_load((tmp_path / "examples/lm.params.yaml").read_text())
    assert lm["acceptance"]["max_kl_mean"] == 0.01  # the override still wins


@pytest.mark.integration
def test_each_example_copied_verbatim_passes_dvc_repro_dry(reproduced, tmp_path):
    """As a user does it: the example's own command (`cp examples/NAME.params.yaml params.yaml && dvc repro`), in a
    repository that has run before. `--dry` runs nothing but checks every stage's params (about 2 s each)."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    shutil.copytree(ROOT / "examples", repo / "examples", dirs_exist_ok=True)  # the working tree's, over the copy's
    commands = {}  # each example's own line, and every such line of the README (an indented block's, comment dropped)
    for name in EXAMPLES:
        header = (ROOT / "examples" / f"{name}.params.yaml").read_text().split("\nseed:")[0]
        commands[re.search(rf"cp examples/{name}\.params\.yaml params\.yaml && dvc repro", header).group(0)] = name
    readme = re.findall(r"(?m)^    (cp examples/\S+.*?)\s*(?:#.*)?$", (ROOT / "README.md").read_text())
    assert len(readme) >= 2, "README.md's `cp examples/... params.yaml && dvc repro` lines"
    for line in readme:
        commands.setdefault(line, re.search(r"examples/(\w+)\.params", line).group(1))
    failed = {}
    ran = set(yaml.safe_load((repo / "params.yaml").read_text())["trial"]["variants"])
    for command, name in commands.items():
        proc = run(["bash", "-c", f"{command} --dry"], repo, check=False)
        new = set(yaml.safe_load((repo / "params.yaml").read_text())["trial"]["variants"]) - ran
        if proc.returncode != 0 and new and "No such file or directory" in proc.stderr:
            # DVC's --dry cannot walk past a stage whose dependency a never-run variant's trial would make;
            # `dvc status` still parses every stage's params (a missing one is its error) and lists the new stages.
            proc = run(["bash", "-c", command.replace("dvc repro", "dvc status")], repo, check=False)
            if proc.returncode != 0 or not all(f"trial@{v}" in proc.stdout for v in new):
                failed[command] = (proc.stderr or proc.stdout)[-1500:]
        elif proc.returncode != 0 or "Running stage 'publish'" not in proc.stdout:
            failed[command] = (proc.stderr or proc.stdout)[-1500:]
        elif (repo / "params.yaml").read_bytes() != (ROOT / "examples" / f"{name}.params.yaml").read_bytes():
            failed[command] = "params.yaml is not the example's file, byte for byte"
    assert not failed, failed


def readme_example_blocks() -> list[tuple[str, dict]]:
    """Each ```yaml block of the README introduced by a mention of `examples/NAME.params.yaml` (since the block before)."""
    text = (ROOT / "README.md").read_text()
    found, since = [], 0
    for match in re.finditer(r"```yaml\n(.*?)```", text, re.DOTALL):
        names = re.findall(r"`examples/(\w+)\.params\.yaml`", text[since : match.start()])
        if names:
            found.append((names[-1], yaml.safe_load(match.group(1))))
        since = match.end()
    return found


def subset_mismatches(shown: dict, actual: dict, path: str = "") -> list[str]:
    out = []
    for key, value in shown.items():
        where = f"{path}{key}"
        if key not in actual:
            out.append(f"{where} is not in the file")
        elif isinstance(value, dict) and isinstance(actual[key], dict):
            out.extend(subset_mismatches(value, actual[key], where + "."))
        elif value != actual[key]:
            out.append(f"{where}: README {value!r}, file {actual[key]!r}")
    return out


def test_the_readme_example_sections_match_the_files():
    """The README's bert and convnet snippets show a part of their file: every value shown is the file's."""
    shown = readme_example_blocks()
    assert sorted(name for name, _ in shown) == ["bert", "convnet"]
    for name, snippet in shown:
        actual = yaml.safe_load((ROOT / "examples" / f"{name}.params.yaml").read_text())
        assert not subset_mismatches(snippet, actual), (name, subset_mismatches(snippet, actual))
    readme = (ROOT / "README.md").read_text()
    for name in set(re.findall(r"examples/(\w+)\.params\.yaml", readme)) - {"NAME"}:
        assert name in EXAMPLES, f"README.md names examples/{name}.params.yaml, which does not exist"
