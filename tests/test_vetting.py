"""vetting.Scan: what freeze vets the rule against, gathered while the reference's outputs stream to disk."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipeline import cases, vetting
from pipeline.config import load_params

ROOT = Path(__file__).resolve().parents[1]


def _scan(chunks, fixed):
    scan = vetting.Scan(load_params(ROOT / "params.yaml"), fixed)
    row = 0
    for chunk in chunks:
        scan.update(row, chunk)
        row += chunk["output"].shape[0]
    return scan


@pytest.mark.parametrize("per_token", [False, True])
def test_the_scan_of_slices_of_rows_is_the_scan_of_whole_chunks(monkeypatch, per_token):
    """An LM's chunk is GBs: the scan squares and scores it a slice of rows at a time, and gets the same RMS, shapes
    and quality as from whole chunks, whichever rows have a target and wherever the chunks and slices end."""
    gen = torch.Generator().manual_seed(0)
    n, shape = 50, ((6, 10) if per_token else (10,))
    out, aux = torch.randn(n, *shape, generator=gen), torch.randn(n, 3, generator=gen) * 5
    y = out.argmax(-1)
    y[::3] = torch.randint(0, 10, y[::3].shape, generator=gen)  # a third of them mislabeled: quality below 1
    has_target = torch.arange(n) % 4 != 0
    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=torch.randn(n, 4), y=y, has_target=has_target)
    chunks = [{"output": out[a:b], "aux": aux[a:b]} for a, b in ((0, 23), (23, 50))]
    whole = _scan(chunks, fixed)
    monkeypatch.setattr(vetting, "SLICE_ELEMENTS", 7 * math.prod(shape))  # 7 rows of the primary output per slice
    sliced = _scan(chunks, fixed)
    assert sliced.shapes == whole.shapes == {"output": shape, "aux": (3,)}
    for name in ("output", "aux"):
        assert math.isclose(sliced.rms()[name], whole.rms()[name], rel_tol=1e-12)
    expected = float((out.argmax(-1) == y)[has_target].double().mean())
    assert math.isclose(whole.quality.result(), expected, rel_tol=1e-12)
    assert math.isclose(sliced.quality.result(), expected, rel_tol=1e-12)
