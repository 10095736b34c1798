"""Timing and memory of training steps, FP32 against AMP, without any check inside the timed region.

FP32 and AMP rounds are interleaved so that drift (thermal, other load) hits both alike. On a GPU,
CUDA events time the steps and the peak of allocated memory is reset before each variant; on the CPU,
a monotonic clock.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from pipeline import precision
from pipeline.precision import Policy


def make_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, lr: float, policy: Policy, device: torch.device) -> Callable[[], None]:
    """One training step in the recipe's order, with no host sync, guard or hook."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = precision.make_scaler(policy, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(policy, device):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()

    return step


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000.0 / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def interleaved(variants: dict[str, Callable[[], None]], warmup: int, repeats: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    for step in variants.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, step in variants.items():
            times[name].append(time_steps(step, steps, device))
    return times


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2], "min": ordered[0], "max": ordered[-1]}


def ratio_spread(num: list[float], den: list[float]) -> dict[str, float]:
    """Per-round ratios (rounds are interleaved, so each pair shares conditions)."""
    return spread([n / d for n, d in zip(num, den)])
