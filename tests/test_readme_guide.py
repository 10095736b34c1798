"""Issue 51: the README is a guide (short, short sentences, every command run by a test); docs/ holds the reference."""

from __future__ import annotations

import re

from _project import ROOT

README = (ROOT / "README.md").read_text()

RUN_BY = {
    "make run": "tests/test_e2e_readme.py (the clone fixture)",
    "make test": "the suite itself (.ci/run)",
    "export PYTHONPATH=": "tests/test_newcomer.py",
    "ls -t mlartifacts/": "tests/test_newcomer.py",
    "dvc exp show --drop": "tests/test_newcomer.py",
    ".venv/bin/mlflow ui": "tests/test_e2e_readme.py",
    "python -m pipeline restore": "tests/test_e2e_readme.py",
    "cp examples/": "tests/test_examples.py (--dry)",
    "docker run": "not runnable here (no Docker engine): tests/test_containers.py checks its flags",
}
"""The first words of each command block of the README, and the test that runs it as written."""
OUTPUT = ("publish: ", "error: ", "freeze: ")
"""Blocks that quote what the tool prints, not commands."""


def prose(text: str) -> str:
    """The text outside code (fenced and indented blocks, inline spans), table rules dropped."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    text = re.sub(r"(?m)^    .*$", "", text)
    text = re.sub(r"`[^`]*`", "X", text)
    return re.sub(r"(?m)^\|[-| ]+\|$", "", text)


def test_the_readme_is_a_guide_of_at_most_300_lines():
    assert len(README.splitlines()) <= 300


def test_no_readme_sentence_is_over_40_words():
    text = prose(README).replace("|", ".")
    sentences = [s for s in re.split(r"(?<=[.!?:;])\s+|\n\s*\n", text) if s.strip()]
    long = [s for s in sentences if len(s.split()) > 40]
    assert not long, long


def test_every_readme_command_is_run_by_a_test():
    blocks = re.findall(r"(?m)(?:^\n)^    (\S.*)$", README)
    assert blocks
    unknown = [b for b in blocks if not b.startswith(OUTPUT) and not any(b.startswith(k) for k in RUN_BY)]
    assert not unknown, f"README commands no test runs: {unknown}; run each in a test and name it in RUN_BY"


def test_every_docs_page_is_linked_and_every_link_resolves():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", README))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert linked <= pages, f"README links to missing pages: {sorted(linked - pages)}"
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([\w.-]+\.(?:md|png))(?:#[\w-]+)?\)", page.read_text()):
            assert (ROOT / "docs" / target).is_file(), f"{page.name} links to {target}, which does not exist"


def test_the_role_table_in_the_readme_is_the_one_freeze_prints():
    """The README's example of freeze's role table is the digits example's, as ``heads.Roles.lines`` writes it."""
    from pipeline import heads
    from pipeline.config import AcceptanceConfig

    roles = heads.resolve("classification", AcceptanceConfig(), {"output": (275, 10)}, "output", threshold=None,
                          over_positions=[], probabilities={}, scales={"output": 4.71})
    block = README.split("    freeze: outputs, as every trial will be judged:\n", 1)[1].split("\n\n", 1)[0]
    assert [line[6:] for line in block.splitlines()] == roles.lines()
