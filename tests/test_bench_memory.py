"""pipeline/bench/memory.py: peak memory of real steps in this process (the CPU path), and the line a probe's
process hands back. The probe's own process, on a frozen project, is tested in test_benchmark.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.artifacts.benchmark import MemoryProbe
from pipeline.bench.memory import MemoryProbes, peak_memory, probe_line
from pipeline.errors import UserError
from pipeline.files import from_jsonable


def test_cpu_peak_memory_sees_what_a_step_allocates() -> None:
    held: list[torch.Tensor] = []

    def step() -> None:  # 64 MiB alive during the step, freed after it
        held.append(torch.ones(16 << 20))
        held.clear()

    probe = peak_memory(step, warmup=1, repeats=3, steps=2, device=torch.device("cpu"))
    assert len(probe.peak) == 3 and probe.skipped == (0, 0, 0)
    if "VmHWM" not in probe.method:
        pytest.skip(f"no resettable peak here: {probe.method}")
    assert all(p - b >= 32 << 20 for p, b in zip(probe.peak, probe.baseline)), "the 64 MiB step's tensor is in the peak"


def test_a_probe_line_reads_back_exactly_nan_included() -> None:
    probe = MemoryProbe((1.0, 2.0), (math.nan, 0.5), (0, 1), "getrusage ru_maxrss (process lifetime)")
    line = probe_line(probe)
    assert "\n" not in line
    back = MemoryProbe.from_dict(from_jsonable(json.loads(line)))
    assert back.peak == probe.peak and math.isnan(back.baseline[0]) and back.skipped == (0, 1)


def test_a_probe_process_that_stops_on_a_user_mistake_passes_its_line_on(tmp_path) -> None:
    (tmp_path / "params.yaml").write_text("device: cpu\nnot_a_key: 1\n")
    with pytest.raises(UserError, match="not_a_key"), MemoryProbes("params.yaml", "float16", ["amp"], cwd=tmp_path) as probes:
        probes.collect()
