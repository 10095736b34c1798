"""The FP64 arbiter's size (reference.fp64_arbiter): every case, none, the first N, or auto by output size."""

from __future__ import annotations

import torch

from pipeline import inference


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _rows(run: inference.Fp64Outputs) -> torch.Tensor:
    return torch.cat([chunk["output"] for chunk in run.chunks])


def test_the_arbiter_covers_the_first_cases_asked_with_the_values_of_a_full_run():
    model, x = _model(), torch.randn(300, 8)
    full = inference.fp64_chunks(model, x, eval_mode=True)
    part = inference.fp64_chunks(model, x, eval_mode=True, cases=70, batch_size=32)
    assert full is not None and part is not None and (full.cases, part.cases) == (300, 70)
    whole, first = _rows(full), _rows(part)
    assert whole.dtype == torch.float64 and first.shape == (70, 4)
    # The same cases' float64 values (to float64 rounding: another batch size blocks the matmuls otherwise).
    torch.testing.assert_close(first, whole[:70], rtol=1e-12, atol=1e-14)
    assert inference.fp64_chunks(model, x, eval_mode=True, cases=0) is None
    assert inference.fp64_chunks(model, x, eval_mode=True, cases=10_000).cases == 300


def test_auto_keeps_every_case_of_a_small_set_and_caps_a_large_one(monkeypatch):
    model, x = _model(), torch.randn(300, 8)
    assert inference.fp64_chunks(model, x, eval_mode=True).cases == 300
    monkeypatch.setattr(inference, "FP64_AUTO_ELEMENTS", 4 * 50)  # 4 outputs per case: 50 cases fit
    assert inference.fp64_chunks(model, x, eval_mode=True).cases == 50
    monkeypatch.setattr(inference, "FP64_AUTO_ELEMENTS", 1)  # fewer than one case's outputs: still one case
    assert inference.fp64_chunks(model, x, eval_mode=True).cases == 1
