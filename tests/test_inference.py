"""The FP64 arbiter's size (reference.fp64_arbiter): every case, none, the first N, or auto by output size."""

from __future__ import annotations

import pytest
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


def test_auto_runs_no_arbiter_for_a_model_too_large_to_copy_in_float64_and_asked_cases_still_run(monkeypatch):
    model, x = _model(), torch.randn(30, 8)
    monkeypatch.setattr(inference, "FP64_AUTO_MODEL_BYTES", 8 * (8 * 16 + 16 + 16 * 4 + 4) - 1)  # one byte short
    assert inference.fp64_chunks(model, x, eval_mode=True) is None
    assert inference.fp64_chunks(model, x, eval_mode=True, cases=30).cases == 30


def test_a_batch_holds_at_most_the_chunk_elements_and_the_values_do_not_change(monkeypatch):
    model, x = _model(), torch.randn(100, 8)
    whole = _rows(inference.fp64_chunks(model, x, eval_mode=True))
    monkeypatch.setattr(inference, "FP64_CHUNK_ELEMENTS", 4 * 7)  # 4 outputs per case: batches of 7 cases
    run = inference.fp64_chunks(model, x, eval_mode=True)
    sizes = [chunk["output"].shape[0] for chunk in run.chunks]
    assert max(sizes) == 7 and sum(sizes) == 100
    torch.testing.assert_close(_rows(inference.fp64_chunks(model, x, eval_mode=True)), whole, rtol=1e-12, atol=1e-14)


def test_a_batchnorm_model_in_training_mode_gets_its_arbiter():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    run = inference.fp64_chunks(model, torch.randn(40, 8), eval_mode=False)  # the probe runs more than one row
    assert run is not None and _rows(run).shape == (40, 4)


def test_on_the_cpu_the_arbiter_stays_on_the_cpu():
    assert inference.fp64_device(_model(), torch.device("cpu")) == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_the_arbiter_runs_there_and_gives_the_cpu_values():
    """A model on the GPU: its float64 copy runs there (a GPU-sized model's float64 forward on one CPU thread takes
    minutes), and the chunks come back as float64 CPU tensors equal to the CPU's within float64 rounding."""
    device = torch.device("cuda")
    model, x = _model(), torch.randn(300, 8)
    on_cpu = _rows(inference.fp64_chunks(model, x, eval_mode=True))
    model.to(device)
    assert inference.fp64_device(model, device) == device
    run = inference.fp64_chunks(model, x, eval_mode=True, device=device)
    on_gpu = _rows(run)
    assert run.cases == 300 and on_gpu.device.type == "cpu" and on_gpu.dtype == torch.float64
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-12, atol=1e-13)
