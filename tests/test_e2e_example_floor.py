"""Issue 51, friction 1, on the user's path: `dvc repro` with params.yaml's min_quality 0.9 (the digits example's
floor) and a reference that misses it is refused at freeze in one line that names the example's floor and the value to
set; that value, set as printed, passes freeze."""

from __future__ import annotations

import re

from _project import dvc, write_params
from conftest import make_project


def test_the_example_floor_refusal_names_the_value_that_then_passes_freeze(tmp_path):
    repo = make_project(tmp_path / "repo", {"acceptance": {"min_quality": 0.9}})  # TINY's reference: accuracy 0.75
    refused = dvc(repo, "repro", "freeze", check=False)
    said = [line for line in (refused.stdout + refused.stderr).splitlines() if "digits example's floor" in line]
    assert refused.returncode != 0 and len(said) == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    value = re.search(r"set your model's own, at most (\S+) \(what the FP32 reference and its replicates reach\)", said[0])
    assert value and "does not meet acceptance.min_quality 0.9" in said[0], said[0]
    write_params(repo, {"acceptance": {"min_quality": float(value.group(1))}})
    dvc(repo, "repro", "freeze")
    assert (repo / "data/reference/manifest.json").is_file()
