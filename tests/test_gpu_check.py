"""scripts/gpu_check.py without running a pipeline: the stage plan comes from the package, and --require-gpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

from pipeline.__main__ import PER_DTYPE, STAGES  # noqa: E402


def test_plan_is_the_packages_stage_order_expanded_over_the_dtypes() -> None:
    params = {**yaml.safe_load((ROOT / "params.yaml").read_text()), "trial": {"dtypes": ["float16", "bfloat16"]}}
    names = [s.name for s in gpu_check.plan(params)]
    assert names[:2] == ["prepare", "freeze"] and names[-1] == "publish" and "restore" not in " ".join(names)
    for dtype in ("float16", "bfloat16"):
        chain = [f"{s}@{dtype}" for s in STAGES if s in PER_DTYPE and s != "restore"]
        assert [names.index(n) for n in chain] == sorted(names.index(n) for n in chain)
    assert next(s for s in gpu_check.plan(params) if s.name == "trial@bfloat16").args == ["trial", "--dtype", "bfloat16"]
    # every DVC stage of dvc.yaml is in the package's order, and nothing else is
    assert {n.split("@")[0] for n in names} == set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --require-gpu lets the check run")
def test_require_gpu_without_one_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), str(out), "--require-gpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists()
