"""A reference that a trial can reproduce: every inference pass draws from the same seed in either mode
(pipeline/inference.py), and freeze's probe refuses a forward whose two FP32 passes still differ (pipeline/probe.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline import inference, probe, rule
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig, Policy, TaskConfig
from pipeline.errors import UserError
from pipeline.task import TensorSource
from _steps import step

CPU = torch.device("cpu")
RULE = AcceptanceConfig(min_quality=None, loss_noise_multiple=None)


class AlwaysDrop(torch.nn.Module):
    """MC dropout left on at inference: ``training=True`` whatever the mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(16, 64), torch.nn.Linear(64, 5)
        with torch.no_grad():
            self.out.weight.mul_(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.dropout(torch.relu(self.inp(x)), 0.3, training=True))


class NumpyNoise(torch.nn.Linear):
    """Noise drawn from numpy's global state, which no torch seed reaches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.from_numpy(np.random.standard_normal(x.shape[0])).float()[:, None]


class Counting(torch.nn.Module):
    """A forward that changes the model's state: in train mode, each call moves a buffer its output reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.fc(x) + 0.01 * self.calls


def _judge(y: torch.Tensor, ref: dict, trial: dict):
    n = len(y)
    sources = streams.Sources([f"ordinary/s{i}" for i in range(n)], y, torch.ones(n, dtype=torch.bool), streams.InMemory(ref),
                              streams.InMemory(trial), streams.InMemory(trial))
    flat = [step(i) for i in range(12)]
    stats, _ = streams.compare_streams("classification", RULE, sources, streams.Trajectories(flat, flat, 1.0),
                                       metric=streams.Metric.for_task(TaskConfig(kind="classification")))
    return rule.decide(stats, RULE)


def test_a_forward_drawing_in_eval_mode_draws_the_same_masks_in_every_pass() -> None:
    """freeze's pass starts where training left the RNG, the trial's where loading did: seeded in train mode alone, an
    always-on dropout drew other masks in each, and an FP32 trial was rolled back on 139 flips no precision caused."""
    model, x = AlwaysDrop(), torch.randn(400, 16, generator=torch.Generator().manual_seed(1))
    ref = inference.infer(model, x, Policy(), CPU, eval_mode=True)
    torch.rand(1000)  # the global RNG has moved on, as between freeze's pass and the trial's
    before = torch.get_rng_state()
    fp32 = inference.infer(model, x, Policy(), CPU, eval_mode=True)
    assert torch.equal(torch.get_rng_state(), before), "inference must not move what training draws next"
    assert torch.equal(fp32["output"], ref["output"])
    y = ref["output"].argmax(1)
    assert _judge(y, ref, fp32).decision == "accept"
    bf16 = inference.infer(model, x, Policy(dtype="bfloat16"), CPU, eval_mode=True)  # the same masks: only rounding
    assert float((bf16["output"] - ref["output"]).abs().max()) < 0.2 < float(ref["output"].abs().max())


def _source(n: int = 8, features: int = 16) -> TensorSource:
    g = torch.Generator().manual_seed(2)
    return TensorSource(torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_the_probe_passes_torch_draws_and_train_mode_dropout() -> None:
    task = TaskConfig(kind="classification")
    probe.check(AlwaysDrop(), _source(), task, CPU, eval_mode=True)
    dropout_bn = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                     torch.nn.Linear(8, 3))
    probe.check(dropout_bn, _source(), task, CPU, eval_mode=False)


@pytest.mark.parametrize("model, eval_mode, mode", [
    (NumpyNoise(16, 3), True, "in eval mode"),
    (Counting(), False, "in train mode (reference.eval_mode: false)"),
])
def test_the_probe_refuses_a_forward_whose_two_passes_differ(model, eval_mode, mode) -> None:
    source = _source(features=16 if isinstance(model, NumpyNoise) else 4)
    with pytest.raises(UserError) as err:
        probe.check(model, source, TaskConfig(kind="classification", model="m:build"), CPU, eval_mode=eval_mode)
    line = str(err.value)
    assert "\n" not in line
    for words in ("task.model m:build: the model's forward is not deterministic", mode, "differ by", "at output 'output'",
                  "training=self.training", "not numpy, random or a generator of your own"):
        assert words in line, line


def test_on_a_gpu_float_rounding_passes_and_a_drawn_difference_does_not() -> None:
    cuda, entry = torch.device("cuda"), "task.model m:f"  # the check reads the device's type only: no GPU needed
    ref = torch.tensor([[3.0, -1.0, torch.finfo(torch.float32).min], [0.5, 2.0, 1.0]])
    rounded = ref.clone()
    rounded[0, 0] = torch.nextafter(ref[0, 0], torch.tensor(10.0))  # one ulp: a reordered sum
    probe.check_reproducible({"output": ref}, {"output": rounded}, entry, cuda, True)
    with pytest.raises(UserError, match=r"differ by 2\.384e-07 at output 'output' element \(0, 0\)"):
        probe.check_reproducible({"output": ref}, {"output": rounded}, entry, CPU, True)  # the CPU: bit for bit
    drawn = ref.clone()
    drawn[1, 0] = 0.0  # a dropped unit; the masked -3.4e38 beside it sets no scale
    with pytest.raises(UserError, match=r"differ by 0\.5 at output 'output' element \(1, 0\)"):
        probe.check_reproducible({"output": ref}, {"output": drawn}, entry, cuda, True)
    nan = torch.tensor([float("nan"), 1.0])
    probe.check_reproducible({"output": nan}, {"output": nan.clone()}, entry, CPU, True)  # NaN on both sides agrees


def test_a_forward_that_draws_is_refused_while_a_variant_compiles() -> None:
    """Inductor draws other numbers than eager FP32 (a compiled FP32 variant of an always-on dropout model moved 19 of
    64 decisions): the probe's pass from another seed tells a drawing forward, and freeze refuses the pair in one line."""
    task = TaskConfig(kind="classification", model="m:build")
    with pytest.raises(UserError) as err:
        probe.check(AlwaysDrop(), _source(), task, CPU, eval_mode=True, compiled=["float32_inductor"])
    line = str(err.value)
    assert "\n" not in line and "draws random numbers at inference" in line and "'float32_inductor'" in line
    assert "compile: off in trial.policies.float32_inductor" in line
    plain = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    probe.check(plain, _source(), task, CPU, eval_mode=True, compiled=["float32_inductor"])  # draws nothing: compiles


def test_a_gpus_reordered_sums_pass_and_the_difference_is_found_in_any_slice() -> None:
    """A layer_norm after a sum whose order a GPU's atomics choose moved by 3.7e-3 of its scale (65,536 messages): float
    rounding, not a draw. The comparison runs by slices (never the whole output in float64) and names the element."""
    cuda, entry = torch.device("cuda"), "task.model m:f"
    ref = torch.randn(2, 3, probe.SLICE // 2 + 5, generator=torch.Generator().manual_seed(3))
    reordered = ref + 3.7e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(4)).clamp(-1, 1)
    probe.check_reproducible({"logits": ref}, {"logits": reordered}, entry, cuda, True)
    late = ref.clone()
    late[1, 2, -1] += 1.0  # past the first slice
    with pytest.raises(UserError, match=r"differ by 1 at output 'logits' element \(1, 2, " + str(ref.shape[-1] - 1) + r"\)"):
        probe.check_reproducible({"logits": ref}, {"logits": late}, entry, CPU, True)
