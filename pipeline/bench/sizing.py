"""How long to measure: params ``bench`` where set, else sized by the device."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import BenchConfig

SIZES = {"cpu": (2, 7, 3), "gpu": (10, 20, 20)}
"""Sizes when params leave ``bench`` fields null: (warmup, repeats, steps). Six rounds or more: fewer give the median's
order-statistic interval no 95 % (``stats.median_interval``), and every speed reads "no measurable difference"; seven
give 98 %, at the extremes."""


@dataclass(frozen=True)
class Sizes:
    warmup: int
    repeats: int
    steps: int
    note: str
    """How the sizes were chosen, in words, for the record."""


def sizes(bench: BenchConfig, device_type: str) -> Sizes:
    """The rounds to run on a ``device_type`` (torch's: ``cpu``, ``cuda``): short on the CPU, saying so."""
    kind = "gpu" if device_type == "cuda" else "cpu"
    given = (bench.warmup, bench.repeats, bench.steps)
    chosen = [auto if v is None else v for auto, v in zip(SIZES[kind], given)]
    if all(v is not None for v in given):
        note = "set in params (bench)"
    elif kind == "cpu":
        note = "sized for the CPU: a short run that shows the method works; its figures say little about a GPU"
    else:
        note = "sized for a GPU: enough rounds for medians and IQRs to quote"
    return Sizes(*chosen, note=note)
