"""pipeline/bench/timing.py: interleaved rounds, the TF32 switch per variant, rounds a skipped update spoils.

Real steps of a tiny model on the CPU (``TrainingStep``: the trial's ``amp_step``), with a GradScaler
started high enough to overflow."""

from __future__ import annotations

import copy

import torch

from pipeline import precision
from pipeline.bench.timing import interleaved, time_steps
from pipeline.bench.workload import TrainingStep, Workload
from pipeline.config import Params
from pipeline.config import Policy

CPU = torch.device("cpu")


def overflowing(scale: float) -> tuple[TrainingStep, TrainingStep]:
    """FP32 and float16 steps of one tiny model; the float16 scaler starts at ``scale``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    state = {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}
    fp32 = TrainingStep(Workload(copy.deepcopy(model), [(x, y)], Params(), CPU, {}), Policy())
    amp = TrainingStep(Workload(copy.deepcopy(model), [(x, y)], Params(), CPU, state), Policy(dtype="float16"))
    return fp32, amp


def test_time_steps_is_seconds_per_step() -> None:
    calls: list[int] = []
    seconds = time_steps(lambda: calls.append(1), 4, CPU)
    assert len(calls) == 4 and seconds > 0


def test_rounds_are_interleaved_with_rotating_order() -> None:
    order: list[str] = []
    steps = {name: (lambda name=name: order.append(name), False) for name in ("fp32", "amp")}
    rounds = interleaved(steps, warmup=1, repeats=3, steps=2, device=CPU)
    assert order == ["fp32", "amp"] + ["fp32"] * 2 + ["amp"] * 2 + ["amp"] * 2 + ["fp32"] * 2 + ["fp32"] * 2 + ["amp"] * 2
    assert {k: len(v) for k, v in rounds.times.items()} == {"fp32": 3, "amp": 3}
    assert all(t > 0 for v in rounds.times.values() for t in v)
    assert rounds.dropped() == [], "plain functions count no updates: nothing is dropped"


def test_variants_switch_tf32_through_the_one_switch() -> None:
    """Timing has no TF32 flag of its own: precision.tf32 sets it for each variant's steps, then restores it."""
    seen: list[tuple] = []
    steps = {name: (lambda: seen.append(precision.tf32_state()), tf32) for name, tf32 in (("fp32", False), ("tf32", True))}
    before = precision.tf32_state()
    interleaved(steps, warmup=0, repeats=1, steps=1, device=CPU)
    assert precision.tf32_state() == before
    off, on = seen
    assert len(set(off)) == 1 and len(set(on)) == 1 and off != on


def test_rounds_with_a_skipped_update_are_dropped() -> None:
    """A forced overflow on the CPU: the scaler starts at 2**22, skips 3 updates, then settles."""
    fp32, amp = overflowing(2.0**22)
    assert amp.scaler.get_scale() == 2.0**22, "the scaler starts from the given state, not a fresh 65536"
    rounds = interleaved({"fp32": (fp32, False), "amp": (amp, False)}, warmup=0, repeats=6, steps=2, device=CPU)
    assert rounds.skipped == {"fp32": [0] * 6, "amp": [2, 1, 0, 0, 0, 0]}
    assert rounds.dropped() == [0, 1]
    kept = rounds.kept_times()
    assert kept["fp32"] == rounds.times["fp32"][2:] and kept["amp"] == rounds.times["amp"][2:]
    assert amp.updates == 12 - 3 and fp32.updates == 12


def test_an_inference_only_verdict_times_a_forward_pass_and_a_trained_one_an_update() -> None:
    """reference.train_steps 0 judges inference only: its benchmark times what it judged, a forward pass under the
    policy (no gradient, no update: the weights stay); otherwise a training update (the weights move)."""
    import dataclasses

    from pipeline.bench.timing import update_count
    from pipeline.bench.workload import InferenceStep, step_for
    from pipeline.config import ReferenceConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    inference_only = dataclasses.replace(Params(), reference=dataclasses.replace(ReferenceConfig(), train_steps=0))
    work = Workload(copy.deepcopy(model), [(x, y)], inference_only, CPU, {})
    before = [p.detach().clone() for p in work.model.parameters()]
    step = step_for(work, Policy(dtype="bfloat16"))
    assert isinstance(step, InferenceStep) and update_count(step) is None
    step()
    assert all(torch.equal(a, b) for a, b in zip(before, work.model.parameters()))
    trained = Workload(copy.deepcopy(model), [(x, y)], Params(), CPU, {})
    step = step_for(trained, Policy())
    assert isinstance(step, TrainingStep)
    step()
    assert update_count(step) == 1 and not all(torch.equal(a, b) for a, b in zip(before, trained.model.parameters()))
