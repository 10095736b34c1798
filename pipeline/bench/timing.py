"""Seconds per step, every variant interleaved round by round, with the rounds a skipped update spoils."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline import precision


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` back-to-back steps (CUDA events on a GPU, else ``perf_counter``)."""
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


def update_count(step: Callable[[], None]) -> int | None:
    """Optimizer updates made so far by a step that counts them (``TrainingStep``); None for a plain function."""
    return getattr(step, "updates", None)


def skipped_since(step: Callable[[], None], before: int | None, steps: int) -> int:
    """Updates the scaler skipped in the ``steps`` steps made since ``update_count`` returned ``before``."""
    return 0 if before is None else steps - (step.updates - before)


@dataclass
class Rounds:
    """Per variant, one value per round: seconds per step, and steps whose update the scaler skipped."""

    times: dict[str, list[float]]
    skipped: dict[str, list[int]]

    def dropped(self) -> list[int]:
        """Rounds in which any variant skipped an update: not comparable, dropped for every variant."""
        n = len(next(iter(self.times.values()), []))
        return [r for r in range(n) if any(s[r] for s in self.skipped.values())]

    def kept_times(self) -> dict[str, list[float]]:
        drop = set(self.dropped())
        return {name: [t for r, t in enumerate(ts) if r not in drop] for name, ts in self.times.items()}


def interleaved(
    steps_by_variant: dict[str, tuple[Callable[[], None], bool]],
    warmup: int,
    repeats: int,
    steps: int,
    device: torch.device,
) -> Rounds:
    """Seconds per step of each variant, one value per round, and the updates skipped in each round.

    ``steps_by_variant`` maps a name to its step function and whether TF32 is allowed while it runs. Round
    ``r`` runs the arms starting from the ``r``-th, so none is always first (or always after another).
    """
    names = list(steps_by_variant)
    for name in names:
        step, tf32 = steps_by_variant[name]
        with precision.tf32(tf32):
            for _ in range(warmup):
                step()
    rounds = Rounds({name: [] for name in names}, {name: [] for name in names})
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, tf32 = steps_by_variant[name]
            before = update_count(step)
            with precision.tf32(tf32):
                rounds.times[name].append(time_steps(step, steps, device))
            rounds.skipped[name].append(skipped_since(step, before, steps))
    return rounds
