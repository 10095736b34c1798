"""Stage compare@DTYPE: value gaps, decision flips, distribution agreement, quality and training gap of one trial.

Outputs are read one chunk of rows at a time (``params.compare.chunk_elements``): memory stays one chunk of
the reference, the trial and the FP64 arbiter, whatever the fixed set's size.
"""

from __future__ import annotations

from pipeline.artifacts import trial

from pipeline.artifacts import reference

from pipeline.artifacts import comparison

from pipeline.compare import streams
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    ref = reference.load(params)
    run = trial.load(dtype, ref.manifest)
    fp64 = ref.fp64_reader()
    stats, table = streams.compare_streams(
        params.task.kind, params.acceptance, list(ref.cases.ids), ref.cases.y, ref.cases.has_target,
        ref.outputs_reader(), run.reader("outputs"), run.reader("trained_outputs"),
        ref.trajectory, run.steps, run.final_scale, fp64, run.scaler_enabled,
        metric=streams.Metric.for_task(params.task, params.task.kind), cfg=params.compare, replicate_steps=ref.replicate,
        token_mask=streams.token_mask_of(ref.cases.x), aligned_steps=run.aligned_steps,
    )
    stats["env_differs_from_reference"] = run.manifest["env_differs_from_reference"]
    comparison.write(dtype, stats, table)
    f, d = stats["flips"], stats["distribution"]
    print(
        f"compare {dtype}: {f['flips']} flip(s), {f['near_boundary_flips']} near the boundary, {f['boundary_flips']}/{f['boundary_cases']} "
        f"boundary flip(s) (per {f['unit']}); quality {stats['quality']['metric']} {stats['quality']['trial']:.4f} vs {stats['quality']['reference']:.4f}"
        + (f"; KL mean {d['kl_mean']:.3g}, top-1 agreement {d['top1_agreement']:.4f}" if d else "")
    )
