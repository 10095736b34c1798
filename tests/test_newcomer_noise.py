"""Issue 51, friction 4: third-party noise silenced at its source (pipeline/quiet.py), the user's own lines kept.

Each case runs in a fresh interpreter, since torchao logs only at its first import: once with the filters, once
without (the control, which shows the noise is there to silence on this machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _project import ROOT
from conftest import import_or_skip

import_or_skip("torchao")
import_or_skip("transformers")
pytestmark = pytest.mark.integration  # fresh processes importing transformers and torchao: seconds each, out of test-fast

SCRIPT = """
import enum, logging, sys, warnings
if sys.argv[1] == "quiet":
    from pipeline.__main__ import silence_third_party_noise  # what every stage calls first
    silence_third_party_noise()
import torch.utils._pytree as pytree
import transformers, torchao  # transformers imports torchao where it is installed, as a user's HF module does
class Mine(enum.Enum):  # the user's own enum: torch's deprecation about it is theirs to see
    A = 1
    def __eq__(self, other):
        return self is other
    __hash__ = enum.Enum.__hash__
pytree.register_constant(Mine)
logging.getLogger("torchao").warning("torchao: a record that is not the extension noise")
warnings.warn("the user's own warning")
print("done")
"""


def run(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout + out.stderr


def test_torchao_noise_is_silenced_and_the_users_lines_are_kept():
    quiet, loud = run("quiet"), run("loud")
    kept = ("<enum 'Mine'> is an Enum subclass", "torchao: a record that is not the extension noise", "the user's own warning")
    for line in kept:
        assert line in quiet and line in loud, (line, quiet)
    assert "Failed to load" not in quiet, quiet
    assert "KernelPreference" not in quiet and "ScaleCalculationMode" not in quiet, quiet
    if "Failed to load" not in loud and "KernelPreference" not in loud:
        pytest.skip("torchao loads its native extensions here and registers no enum: nothing to silence (kept lines checked)")


def test_the_filters_are_installed_once():
    import logging

    from pipeline import quiet

    quiet.silence_third_party_noise()
    quiet.silence_third_party_noise()
    assert all(len([f for f in logging.getLogger(n).filters if isinstance(f, quiet._Drop)]) == 1 for n in quiet.NOISE)


FLOAT8 = """
import logging, torch
from pipeline import transforms  # library code, without the stage entry point's filters
from pipeline.config import Policy
model = torch.nn.Sequential(torch.nn.Linear(32, 32))
print(transforms.apply(model, Policy(float8="tensorwise"), torch.device("cpu")).float8_linears)
logging.getLogger("torchao").warning("torchao: a record that is not the extension noise")
"""


def test_a_float8_variant_built_outside_a_stage_gets_the_same_filters():
    """pipeline/transforms.py imports torchao through pipeline/quiet.py's filters (one definition of the noise), not by
    raising the loggers' level for the import, which hid every other torchao record of it too."""
    out = subprocess.run([sys.executable, "-c", FLOAT8], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    said = out.stdout + out.stderr
    assert "('0',)" in said and "torchao: a record that is not the extension noise" in said, said
    assert "Failed to load" not in said and "KernelPreference" not in said, said
    from pipeline import transforms

    assert not hasattr(transforms, "_quiet_import")
