"""The FP16 headroom forecast on tiny real models, each then trained for a few real float16 steps on the CPU (autocast,
GradScaler, ``training.amp_step``) to see that what the forecast said is what float16 does."""

from __future__ import annotations

import hashlib

import _steps
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import precision, training
from pipeline.artifacts import forecast as forecast_file
from pipeline.artifacts.steps import StepRecord
from pipeline.config import Policy
from pipeline.diagnosis import precision_map
from pipeline.errors import UserError
from pipeline.forecast import binades_of, forecast, halvings_to_fit

CPU = torch.device("cpu")
FP16 = Policy(dtype="float16")


def batches(n: int = 2, rows: int = 16, classes: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(rows, 8), torch.randint(0, classes, (rows,))) for _ in range(n)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


class Loud(nn.Module):
    """One layer scaled so that its activations exceed 65504; a LayerNorm brings them back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.loud, self.norm, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3)
        with torch.no_grad():
            self.loud.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.loud(torch.relu(self.inp(x)))))


def trial(model: nn.Module, data, loss, policy: Policy, steps: int, lr: float = 1e-3) -> tuple[list[StepRecord], bool]:
    """A float16 trial in miniature: real amp_step updates, and whether the trained model's outputs are finite."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = precision.make_scaler(policy, CPU)
    records = []
    with precision.fp32_regions(model, policy, CPU):
        for step in range(steps):
            x, y = data[step % len(data)]
            out = training.amp_step(model, [(x, y)], lambda m, x, y: loss(m(x), y), optimizer, scaler, policy, CPU)
            records.append(_steps.step(step, out.loss, scale=out.scale, skipped=out.skipped))
        with torch.no_grad(), precision.autocast(policy, CPU):
            finite = bool(torch.isfinite(model(data[0][0])).all())
    return records, finite


def both(f: forecast_file.Forecast) -> forecast_file.Headroom:
    """The file's record for a model whose forecast does not change with training (the same at both ends)."""
    return forecast_file.headroom(f, f)


def test_healthy_mlp_is_safe_and_the_trial_agrees():
    model, data = mlp(), batches()
    f = forecast(model, data, F.cross_entropy, CPU)
    assert f.recommendation == "fp16 is safe" and f.fp32_modules == () and f.beyond_fp16 == ()
    assert f.halvings == 0 and f.settled_scale == 65536.0 and f.overflow_fraction == 0.0
    assert f.underflow_fraction == 0.0 and f.parameter_gradients.nonzero > 0
    assert f.parameter_gradients.elements == 2 * (8 * 32 + 32 + 32 * 3 + 3)  # two batches
    assert 1.0 < f.largest_activation < 100.0 and f.line.startswith("fp16 is safe: largest activation")
    assert all(p.grad is None for p in model.parameters())

    steps, finite = trial(model, data, F.cross_entropy, FP16, steps=6)
    assert [s.skipped for s in steps] == [False] * 6 and finite
    verdict = forecast_file.check(both(f), steps, finite, ())
    assert verdict.held and verdict.line.startswith("forecast held:")


def test_layer_beyond_fp16_is_named_really_overflows_and_its_fp32_regions_fix_it():
    model, data = Loud(), batches()
    f = forecast(model, data, F.cross_entropy, CPU)
    assert f.modules["loud"].max_abs_output > 65504 and f.modules["norm"].max_abs_input > 65504
    assert f.modules["inp"].beyond_fp16 is False and f.modules["head"].beyond_fp16 is False
    assert f.beyond_fp16 == ("loud", "norm")  # the root's output comes from head: it is not beyond
    assert f.recommendation == "fp16 needs fp32_modules" and f.fp32_modules == ("loud", "norm")
    assert f.line.startswith("fp16 needs fp32_modules ['loud', 'norm']") and f.largest_activation_module == "loud"

    seen = {}
    model.loud.register_forward_hook(lambda m, a, out: seen.update(loud=out))
    with torch.no_grad(), precision.autocast(FP16, CPU):
        out = model(data[0][0])
    assert seen["loud"].dtype == torch.float16 and bool(torch.isinf(seen["loud"]).any())  # a real float16 overflow
    assert not bool(torch.isfinite(out).all())
    fixed = Policy(dtype="float16", fp32_modules=f.fp32_modules)
    with torch.no_grad(), precision.fp32_regions(model, fixed, CPU), precision.autocast(fixed, CPU):
        assert bool(torch.isfinite(model(data[0][0])).all())

    steps, finite = trial(Loud(), data, F.cross_entropy, FP16, steps=6)
    assert all(s.skipped for s in steps) and not finite  # every loss inf: the scale collapses
    assert forecast_file.check(both(f), steps, finite, ()).held
    steps, finite = trial(Loud(), data, F.cross_entropy, fixed, steps=6)
    assert finite and forecast_file.check(both(f), steps, finite, fixed.fp32_modules).held
    # Inference only (reference.train_steps 0): no steps; the outputs alone hold or miss the forecast.
    assert forecast_file.check(both(f), [], False, ()).held  # exposed, and they overflowed
    missed = forecast_file.check(both(f), [], True, ())
    assert not missed.held and "ran no training (inference only), outputs finite" in missed.line
    assert forecast_file.check(both(f), [], True, fixed.fp32_modules).held  # kept in FP32: finite, as forecast


def tiny_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) * 1e-12


def test_tiny_gradients_underflow_even_scaled_so_use_bf16():
    model, data = mlp(), batches()
    f = forecast(model, data, tiny_loss, CPU)
    assert f.recommendation == "use bf16" and f.fp32_modules == ()
    assert f.underflow_fraction > 0.99 and f.halvings == 0
    assert "underflow float16 even at scale 65536" in f.line

    # Real float16 autocast and backward at the GradScaler's 65536: the gradients really vanish.
    x, y = data[0]
    real = precision_map.gradient_underflow(model, x, y, tiny_loss, FP16, CPU, scale=65536.0)
    assert real.total.vanished_scaled / real.total.nonzero_fp32 > 0.99
    steps, finite = trial(model, data, tiny_loss, FP16, steps=4)
    assert forecast_file.check(both(f), steps, finite, ()).held  # no skips: the scaler never sees a zero


def loud_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) * 1e4


def test_large_gradients_forecast_the_scalers_halvings():
    model, data = mlp(), batches(n=1)
    f = forecast(model, data, loud_loss, CPU)
    assert f.recommendation == "fp16 is safe" and f.halvings > 2
    assert f.overflow_fraction > 0 and f.settled_scale == 65536.0 / 2**f.halvings
    assert f"the GradScaler halves 65536 {f.halvings} times" in f.line

    steps, finite = trial(model, data, loud_loss, FP16, steps=f.halvings + 4, lr=1e-7)  # the loss's 1e4 taken back
    leading = next(i for i, s in enumerate(steps) if not s.skipped)
    assert abs(leading - f.halvings) <= 1, (leading, f.halvings)
    verdict = forecast_file.check(both(f), steps, finite, ())
    assert verdict.held, verdict.line

    healthy = forecast(mlp(), data, F.cross_entropy, CPU)
    missed = forecast_file.check(both(healthy), steps, finite, ())
    assert not missed.held and missed.line.startswith("forecast missed: expected finite outputs and 0 leading skipped")


def test_halvings_to_fit():
    assert halvings_to_fit(0.5, 65536.0) == 0  # 32768 fits
    assert halvings_to_fit(1.0, 65536.0) == 1  # 65536 > 65504 by a hair
    assert halvings_to_fit(100.0, 65536.0) == 7  # 6553600 / 2**7 = 51200


def test_gradient_binades_are_the_float64_log2s_at_any_scale():
    """The exponent-field shortcut of a power-of-two scale bins every element where floor(log2(v * scale / 2**-24)) + 1
    does, float32 subnormals, binade edges and the largest floats included; another scale takes that log2 itself."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(100_000, generator=g).abs() * torch.exp(torch.randn(100_000, generator=g) * 20)
    edges = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-25, 2.0**-24, 0.5, 1.0, 2.0, 3.9999998, 4.0, 65504.0, 1e30, 3.4e38])
    for values in (spread[torch.isfinite(spread)], edges, torch.zeros(5)):
        for scale in (65536.0, 1.0, 2.0**-10, 2.0**60, 2.0**101, 2.0**102, 3000.0):
            live = values[values > 0]
            expected = torch.floor(torch.log2(live.double() * scale / 2.0**-24)) + 1
            expected = torch.bincount(expected.clamp(0, 192).long(), minlength=193)
            assert torch.equal(binades_of(values, scale, live.numel()), expected), scale


def test_the_worse_end_of_training_recommends_and_the_check_reads_both_ends():
    safe, loud = forecast(mlp(), batches(), F.cross_entropy, CPU), forecast(Loud(), batches(), F.cross_entropy, CPU)
    grown = forecast_file.headroom(safe, loud)  # activations that leave float16's range as the weights grow
    assert grown.worse == "trained" and grown.recommendation == "fp16 needs fp32_modules"
    assert grown.fp32_modules == ("loud", "norm") and grown.beyond_fp16 == ("loud", "norm")
    assert grown.line.endswith("(at the reference's trained weights; at its initial weights: fp16 is safe)")
    assert forecast_file.headroom(loud, safe).worse == "initial" and forecast_file.headroom(safe, safe).worse == "initial"

    clean = [_steps.step(i, scale=65536.0) for i in range(6)]
    missed = forecast_file.check(grown, clean, True, ())  # the trained end's overflow was expected, and did not come
    assert not missed.held and "activations beyond 65504 in ['loud', 'norm']" in missed.expected
    held = forecast_file.check(grown, clean, True, ("loud", "norm"))  # kept in FP32: the initial end's 0 halvings hold
    assert held.held and held.recommendation == "fp16 needs fp32_modules" and held.forecast == grown.line

    loud_grads = forecast(mlp(), batches(n=1), loud_loss, CPU)
    late = forecast_file.headroom(safe, loud_grads)  # only the trained end's gradients need halvings
    assert late.worse == "trained" and late.initial.halvings == 0 < late.trained.halvings
    assert forecast_file.check(late, clean, True, ()).held  # the trial starts from the initial end: no leading skips


def test_both_ends_needing_fp32_modules_need_them_all():
    loud = forecast(Loud(), batches(), F.cross_entropy, CPU)
    quiet_norm = forecast_file.Forecast.from_dict({**loud.as_dict(), "beyond_fp16": ["loud"], "fp32_modules": ["loud"]})
    h = forecast_file.headroom(quiet_norm, loud)
    assert h.fp32_modules == ("loud", "norm") and h.line.startswith("fp16 needs fp32_modules ['loud', 'norm']: activations")
    assert "initial weights (['loud'])" in h.line and "trained weights (['loud', 'norm'])" in h.line


def test_forecast_file_reads_back_key_for_key(tmp_path):
    f = both(forecast(Loud(), batches(n=1), F.cross_entropy, CPU))
    forecast_file.write(tmp_path, f)
    assert forecast_file.read(tmp_path) == f
    digest = hashlib.sha256((tmp_path / forecast_file.FILE).read_bytes()).hexdigest()
    assert forecast_file.read(tmp_path, "freeze", digest) == f
    with pytest.raises(UserError, match="differs from"):
        forecast_file.read(tmp_path, "freeze", "0" * 64)
    (tmp_path / forecast_file.FILE).write_text('{"halvings": 0}')
    with pytest.raises(UserError, match="is not a forecast of this version; rebuild it with `dvc repro forecast@x`"):
        forecast_file.read(tmp_path, "forecast@x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_the_forecast_counts_gradients_there_with_the_cpu_counts():
    """The gradients' histogram is counted on the device (a GPU-sized model's activation gradients, gigabytes a batch,
    kept freeze busy for minutes when copied to one CPU thread): the same counts as the CPU's, maxima within float32
    rounding of the two devices' kernels."""
    cuda = torch.device("cuda")
    on_cpu = forecast(Loud(), batches(), F.cross_entropy, CPU)
    precision.strict_fp32()
    on_gpu = forecast(Loud().to(cuda), [(x.to(cuda), y.to(cuda)) for x, y in batches()], F.cross_entropy, cuda)
    assert (on_gpu.recommendation, on_gpu.fp32_modules, on_gpu.halvings) == (on_cpu.recommendation, on_cpu.fp32_modules,
                                                                          on_cpu.halvings)
    for side in ("parameter_gradients", "activation_gradients"):
        a, b = getattr(on_cpu, side), getattr(on_gpu, side)
        assert (a.elements, a.nonzero) == (b.elements, b.nonzero), side
        assert b.max_abs == pytest.approx(a.max_abs, rel=1e-4), side
