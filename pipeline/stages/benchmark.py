"""Stage benchmark@NAME: time per training step and peak memory, strict FP32 (and TF32) vs AMP, accepted variants only.

``pipeline.bench`` holds the method (``bench.measure`` runs it, FP32 timed twice so that the speedup is judged against
the timing's own noise); ``pipeline.artifacts.benchmark`` writes the record (``benchmark.json``, with the speed verdict)
and its two DVC metrics (``data/metrics/bench-NAME.json``: speedup, mem_ratio).
"""

from __future__ import annotations

from pipeline import devices, distributed, launch, paths, sysmetrics
from pipeline.artifacts import benchmark, decision
from pipeline.bench.measure import measure
from pipeline.config import load_params


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if launch.relaunched("benchmark", params, params_path, variant):
        return  # it ran on distributed.nproc_per_node ranks under torchrun
    device = distributed.init(devices.resolve(params.device))  # one process: unchanged; under torchrun: this rank's
    with sysmetrics.sampling(paths.system_metrics("benchmark", variant), devices.backend(device), distributed.current().writes):
        if decision.read(variant).accepted:
            result = measure(params_path, params, variant, device)  # every rank measures; rank 0 alone gets the record
        else:
            result = benchmark.rolled_back(variant)
    if distributed.current().writes:
        benchmark.write(result)
        print(result.summary_line())
