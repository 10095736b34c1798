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


def test_an_outputs_scale_is_its_scale_on_the_ordinary_cases_too(monkeypatch):
    """A regression whose outputs are about 0.01 on the application's cases, and the fixed set prepare builds around
    them (``cases.edge_cases``: inputs x1e-4 and x100). Over the whole set the x100 cases give an RMS 7x larger, under
    which the default atol 0.05 passed freeze, and a trial that answers 0 on every ordinary case was accepted. The scale
    an atol must be below is also the ordinary cases' (the smaller of the two), whatever the slices."""
    from pipeline.config import AcceptanceConfig, Params, PrepareConfig, TaskConfig

    from _steps import step

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 2, bias=False))
    with torch.no_grad():
        net[2].weight.mul_(0.05)
    x = torch.randn(256, 8)
    ordinary = cases.Cases(ids=[f"ordinary/{i}" for i in range(256)], x=x, y=torch.zeros(256, 2),
                           has_target=torch.ones(256, dtype=torch.bool))
    fixed = ordinary + cases.edge_cases(ordinary, torch.randn(1000, 8), PrepareConfig(), ordinary.y)
    with torch.no_grad():
        ref = net(fixed.x)
    fixed = cases.Cases(ids=fixed.ids, x=fixed.x, y=ref + 0.02 * torch.randn(ref.shape), has_target=fixed.has_target)
    on_ordinary = float(ref[:256].double().square().mean().sqrt())
    assert float(ref.square().mean().sqrt()) > 5 * on_ordinary  # the case: edge cases set the pooled scale
    params = Params(task=TaskConfig(kind="regression", loss="mse"),
                    acceptance=AcceptanceConfig(min_quality=None, loss_noise_multiple=None))
    for limit in (vetting.SLICE_ELEMENTS, 50):  # whole chunks, then slices of 25 rows that cut across the kinds
        monkeypatch.setattr(vetting, "SLICE_ELEMENTS", limit)
        scan = vetting.Scan(params, fixed)
        scan.update(0, {"output": ref[:300]})
        scan.update(300, {"output": ref[300:]})
        assert math.isclose(scan.rms()["output"], on_ordinary, rel_tol=1e-9)
        columns = ref[:256].double().square().mean(0).sqrt().tolist()
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(scan.column_rms()["output"], columns))
        line = scan.problem([step(0, 1.0)])
        assert "atol 0.05 is not below the scale" in line and f"RMS {on_ordinary:.3g}" in line, line


def test_the_real_units_of_the_fixed_set_are_its_cases_less_the_constructed_ones_per_token_the_kept_positions():
    """What ``max_flip_rate``'s bound at freeze counts: compare's real cases (ordinary, edge; not ``boundary``), per token
    the positions whose target is not ignored (-100)."""
    ids = [f"ordinary/{i}" for i in range(6)] + ["edge/zeros", "boundary/0~1", "boundary/2~3"]
    n = len(ids)
    per_case = cases.Cases(ids=ids, x=torch.zeros(n, 2), y=torch.zeros(n, dtype=torch.long),
                           has_target=torch.ones(n, dtype=torch.bool))
    scan = _scan([{"output": torch.randn(n, 4)}], per_case)
    assert scan.real_units() == 7
    y = torch.zeros(n, 5, dtype=torch.long)
    y[0, 3:] = -100  # two ignored positions of a real case
    y[7, :] = -100  # a constructed case: not counted whatever its targets
    per_token = cases.Cases(ids=ids, x=torch.zeros(n, 5), y=y, has_target=torch.ones(n, dtype=torch.bool))
    scan = _scan([{"output": torch.randn(n, 5, 4)}], per_token)
    assert scan.real_units() == 7 * 5 - 2
