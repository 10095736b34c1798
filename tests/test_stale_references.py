"""Issue 51 moved the README's reference sections to docs/: a comment, docstring, message or page that still sends
a reader to a README section names one README.md has (``README "Title"``, ``README's "Title"``, ``README.md#anchor``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = re.compile(r"""README(?:\.md)?(?:'s)?,? \(?(?:former section )?\\?"([^"\\]+)\\?\"""")
ANCHOR = re.compile(r"README\.md#([\w-]+)")


def _anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_readme_section_named_elsewhere_is_in_the_readme():
    titles = set(re.findall(r"(?m)^#+ (.+)$", (ROOT / "README.md").read_text()))
    anchors = {_anchor(t) for t in titles}
    files = subprocess.run(["git", "ls-files", "pipeline", "scripts", "docs", "examples", "tests", "Makefile", ".github",
                            "params.yaml", "dvc.yaml"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    stale = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".safetensors", ".json") or not path.is_file() or name == "tests/test_stale_references.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "former section" in line:  # a page saying where a section went
                continue
            stale += [f"{name}:{n}: README {t!r}" for t in SECTION.findall(line) if t not in titles]
            stale += [f"{name}:{n}: README.md#{a}" for a in ANCHOR.findall(line) if a not in anchors]
    assert not stale, "references to README sections that moved to docs/ (name the docs page instead):\n" + "\n".join(stale)
