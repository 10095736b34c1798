"""Start-up costs a stage process must not pay (issue 13): each was a second per stage on 2 cores.

Every stage is its own process, so an import that is not needed is paid by every `dvc repro`, once per
stage. These tests run in a fresh interpreter and look at what it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` in the repository."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_digits_examples_load_their_data_without_importing_scikit_learn():
    loaded = modules_after(
        "from pipeline.examples import convnet, digits\n"
        "digits.load_data(); digits.build_model(); convnet.load_data(); convnet.load_dataset(); convnet.build_model()"
    )
    assert "pipeline.examples.convnet" in loaded
    assert not {m for m in loaded if m == "sklearn" or m.startswith("sklearn.")}, "importing scikit-learn costs ~1 s per stage"


def test_the_digits_table_is_the_one_scikit_learn_loads():
    from sklearn.datasets import load_digits

    from pipeline.examples.digits import digits_table

    pixels, labels = digits_table()
    bunch = load_digits()
    assert pixels.dtype == bunch.data.dtype and np.array_equal(pixels, bunch.data)
    assert labels.dtype == bunch.target.dtype and np.array_equal(labels, bunch.target)


def test_non_deterministic_mode_leaves_inductor_unimported():
    """torch.use_deterministic_algorithms imports Inductor's config (torch >= 2.6): called only for a change."""
    loaded = modules_after(
        "import torch\n"
        "from pipeline import precision\n"
        "precision.deterministic(False)\n"
        "with precision.deterministic(False):\n"
        "    torch.ones(2) @ torch.ones(2)\n"
        "assert not torch.are_deterministic_algorithms_enabled()"
    )
    assert "torch._inductor.config" not in loaded


def test_deterministic_mode_is_still_set_and_restored():
    import torch

    from pipeline import precision

    assert not torch.are_deterministic_algorithms_enabled()
    with precision.deterministic(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
