"""Stage compare@NAME: value gaps, decision flips, distribution agreement, quality and training gap of one trial.

Outputs are read one chunk of rows at a time (``params.compare.chunk_elements``): memory stays one chunk of
the reference, the trial and the FP64 arbiter, whatever the fixed set's size. Where ``device`` resolves to a GPU,
each chunk's arithmetic runs there (host memory is still one chunk).
"""

from __future__ import annotations

from dataclasses import replace

from pipeline import devices, task
from pipeline.artifacts import comparison, reference_tensors, trial, trial_tensors
from pipeline.compare import streams
from pipeline.config import load_params


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if (failed := trial.read_failure(variant)) is not None:  # it raised under its policy: no outputs, decide rolls it back
        comparison.write_failed(variant, failed.as_dict())
        print(f"compare {variant}: nothing to compare, the trial failed under its policy ({failed.part}: {failed.error})")
        return
    ref = reference_tensors.load(params)
    run = trial_tensors.load(variant, ref.manifest)
    fp64 = ref.fp64_reader()
    sources = streams.Sources(ref.cases.ids, ref.cases.y, ref.cases.has_target, ref.outputs_reader(), run.reader("outputs"),
                              run.reader("trained_outputs"), fp64, task.token_mask_of(ref.cases.x))
    t = run.trajectory
    runs = streams.Trajectories(ref.trajectory, t.steps, t.final_scale, t.scaler_enabled, ref.replicate, t.aligned_fp32,
                                ref.spread, ref.replicates[1:])
    stats, table = streams.compare_streams(params.task.kind, params.acceptance, sources, runs,
                                           metric=streams.Metric.for_task(params.task), cfg=params.compare,
                                           device=devices.resolve(params.device),  # a GPU computes its chunks
                                           roles=ref.manifest.output_roles())  # freeze's table: nothing re-inferred
    stats = replace(stats, env_differs_from_reference=tuple(run.manifest.env_differs_from_reference))
    comparison.write(variant, stats, table)
    f, d, q = stats.flips, stats.distribution, stats.quality
    print(
        f"compare {variant}: {f.flips} flip(s), {f.near_boundary_flips} near the boundary, {f.boundary_flips}/{f.boundary_cases} "
        f"boundary flip(s) (per {f.unit}); quality {q.metric} {q.trial:.4f} vs {q.reference:.4f}"
        + (f"; KL mean {d.kl_mean:.3g}, top-1 agreement {d.top1_agreement:.4f}" if d else "")
    )
