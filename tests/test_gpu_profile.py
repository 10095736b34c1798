"""scripts/gpu_profile.py: the profile a GPU session reads when AMP's speedup falls short, run here on the CPU
at tiny size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _project import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_profile


def test_gpu_profile_on_the_cpu_at_tiny_size(tmp_path: Path) -> None:
    assert gpu_profile.main([str(tmp_path), "--size", "tiny", "--steps", "2"]) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    assert set(result["variants"]) == {"fp32", "amp"} and result["flops_per_step"] > 0
    for v in result["variants"].values():
        assert v["seconds_per_step"] > 0 and v["top_ops"] and all(0 <= o["share"] <= 1 for o in v["top_ops"])
    assert "| amp |" in (tmp_path / "profile.md").read_text()
