"""Stage benchmark@NAME: time per training step and peak memory, strict FP32 (and TF32) vs AMP, accepted variants only.

``pipeline.bench`` holds the method (``bench.measure`` runs it, FP32 timed twice so that the speedup is judged against
the timing's own noise); ``pipeline.artifacts.benchmark`` writes the record (``benchmark.json``, with the speed verdict)
and its two DVC metrics (``data/metrics/bench-NAME.json``: speedup, mem_ratio): both replaced together or not at all
(``files.StagedFolder``, ``files.StagedFile``), so a full disk leaves the previous record and its metrics.
"""

from __future__ import annotations

from pipeline import devices, distributed, files, launch, paths, sysmetrics
from pipeline.artifacts import benchmark, decision
from pipeline.bench.measure import measure
from pipeline.config import load_params


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if launch.relaunched("benchmark", params, params_path, variant):
        return  # it ran on distributed.nproc_per_node ranks under torchrun
    device = distributed.init(devices.resolve(params.device), params.distributed)  # under torchrun: this rank's (FSDP2?)
    with sysmetrics.sampling(paths.system_metrics("benchmark", variant), devices.backend(device), distributed.current().writes):
        if decision.read(variant).accepted:
            result = measure(params_path, params, variant, device)  # every rank measures; rank 0 alone gets the record
        else:
            result = benchmark.rolled_back(variant)
    if distributed.current().writes:
        with (files.StagedFolder(paths.benchmark(variant), owned={benchmark.FILE}) as out,
              files.StagedFile(paths.benchmark_metrics(variant)) as metrics):
            files.write_json(out / benchmark.FILE, result.as_dict())  # (``benchmark.write``'s two files, staged)
            files.write_json(metrics, result.metrics())
        print(result.summary_line())
