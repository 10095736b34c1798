"""What publish mirrors to MLflow, as data: one parent run per pipeline execution, one child run per variant.

Pure: the loaded variants in (``pipeline.artifacts.variant.Variant``: typed records), ``tracking.RunSpec`` out; no MLflow, no
file reads (files to upload are named by path, and only those that exist are named).

The parent holds the verdict block first (its description, report.html), the reference and the params.
Under it, ONE child run per variant, named by its decision ("ROLLBACK bfloat16"), with the decision and the
key figures as metric columns (units in the names), the per-step curves (FP32 and AMP loss, their gap and
the band the rule allows), the figures, the per-case table, the suggested params and the rollback package.
The stages' own JSON outputs ride along as artifacts under ``stages/``: a reviewer compares variants and
executions in the runs table, one row per variant, and opens the details when needed; a run per stage
variant made 12 rows per execution, most of them with nothing to compare.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import paths, rule
from pipeline.artifacts.reference import Manifest
from pipeline.artifacts.steps import Steps
from pipeline.config import AcceptanceConfig
from pipeline.files import flatten
from pipeline.present import page, verdict
from pipeline.tracking import EarlierRule, ModelSpec, RunSpec

if TYPE_CHECKING:
    from pipeline.artifacts.benchmark import Benchmark
    from pipeline.artifacts.comparison import Arbiter, Stats
    from pipeline.artifacts.decision import Decision
    from pipeline.artifacts.variant import Variant

KEY_COLUMNS = (
    "accepted", "flips", "near_boundary_flips", "boundary_flips", "max_abs_gap", "quality_trial", "quality_trained",
    "max_loss_gap", "speedup_median", "working_memory_ratio",
)
"""The key figures: the children's columns the parent repeats, per variant, so that executions compare in one
table; and the metrics linked to each variant's model."""


SHORT = {"float16": "fp16", "bfloat16": "bf16"}
MARK = {"accept": "✓", "rollback": "✗"}
"""The parent's name in short: its children are collapsed under it in the runs table, whose name column shows
about 15 characters; each child's name keeps the words ("ROLLBACK bfloat16")."""


def run_name(verdicts_: Sequence[verdict.Verdict], suffix: str = "") -> str:
    """Every variant's verdict within the characters the runs table shows, rollbacks first: "✗ bf16, ✓ fp16 3e85c902"."""
    order = sorted(verdicts_, key=lambda v: v.decision == "accept")
    return " ".join([", ".join(f"{MARK[v.decision]} {SHORT.get(v.variant, v.variant)}" for v in order), suffix]).strip()


def common_tags(commit: str, manifest: Manifest, dvc_experiment: str | None) -> dict[str, str]:
    """Tags of every run of one execution: the code version, the rule and the reference it was judged against."""
    return {
        "git_commit": commit, "mlflow.source.git.commit": commit, "rule_sha256": manifest.rule_sha256,
        "reference_run_key": manifest.run_key, **({"dvc_experiment": dvc_experiment} if dvc_experiment else {}),
    }


def loosened(decision: Decision, earlier_rollbacks: Sequence[EarlierRule]) -> list[str]:
    """How the rule of an accept is looser than a rule under which this reference was rolled back before.

    ``earlier_rollbacks`` is what ``tracking.Publisher.earlier_rollbacks`` found.
    """
    if not decision.accepted:
        return []
    out: list[str] = []
    for earlier in earlier_rollbacks:
        out += [
            f"{d} (rolled back under rule {earlier.rule_sha256[:12]})"
            for d in rule.loosened(earlier.rule, decision.acceptance())
        ]
    return out


def verdicts(variants: Mapping[str, Variant], loosened_by_dtype: Mapping[str, list[str]]) -> list[verdict.Verdict]:
    """Every variant's verdict, with what publish alone knows: how the rule was loosened since a rollback."""
    return [verdict.of(v, loosened_by_dtype.get(d, [])) for d, v in variants.items()]


def parent(
    manifest: Manifest, variants: Mapping[str, Variant], verdicts_: Sequence[verdict.Verdict],
    ref_steps: Steps, common: Mapping[str, str], flat: dict, params_path: str,
) -> RunSpec:
    """The pipeline execution: the verdict block first (description, report.html, with freeze's role table), the
    reference, params."""
    summary = page.markdown(manifest, list(variants.values()), verdicts_)
    suffix = " ".join(filter(None, [common.get("dvc_experiment"), common["git_commit"][:8]]))
    ref_metrics = {
        "reference.real_updates": manifest.real_updates, "reference.final_loss": ref_steps[-1].loss if ref_steps else None,
    }
    return RunSpec(
        name=run_name(verdicts_, suffix),
        tags={**common, **env_tags(manifest.env), "stage": "pipeline", "variants": ",".join(variants),
              **{f"decision.{d}": v.decision.decision for d, v in variants.items()},
              **{f"reasons_count.{d}": str(len(v.decision.reasons)) for d, v in variants.items()}},
        params=flat,
        metrics={
            **ref_metrics,
            **{f"{d}.{k}": x for d, v in variants.items() for k, x in columns(v).items() if k in KEY_COLUMNS},
        },
        steps={"loss_fp32": [(s.step, s.loss) for s in ref_steps], "grad_norm_fp32": [(s.step, s.grad_norm) for s in ref_steps]},
        artifacts=[(p, "") for p in (Path(params_path), Path("dvc.lock")) if p.is_file()]
        + [(paths.REF_MANIFEST, "reference"), (paths.REF_TRAJECTORY, "reference")],
        # The report quotes benchmark timings: built here, not as a DVC output (those rerun byte for byte).
        texts={"report.html": page.html(manifest, list(variants.values()), verdicts_), "summary.md": summary},
        note=summary,
        models=[ModelSpec(
            "reference float32", [paths.REF_CHECKPOINT],
            tags={**common, **env_tags(manifest.env), "stage": "reference", "dtype": "float32"},
            metrics=ref_metrics,  # the run's own names: linked to the model, not logged twice
        )] if paths.REF_CHECKPOINT.is_file() else [],
    )


def child(v: Variant, verdict_: verdict.Verdict, loosened_: list[str], ref_steps: Steps,
          replicate_steps: Steps | None, common: Mapping[str, str], flat: dict) -> RunSpec:
    """One variant: decision and key figures as columns, curves, figures, table, suggestion, rollback package."""
    return RunSpec(
        name=f"{v.decision.decision.upper()} {v.name}",
        tags=child_tags(v, loosened_, common),
        params=flat,
        metrics=columns(v),
        steps=curves(ref_steps, v.trajectory.steps if v.trajectory else (),  # None: the trial failed under its policy
                     v.decision.acceptance(), replicate_steps),
        artifacts=child_artifacts(v.name),
        # flipped cases first: the table opens on them, not after pages of unchanged cases
        tables={"cases.json": sorted(v.cases, key=lambda r: not r.get("flipped"))} if v.cases is not None else {},
        note=verdict.markdown([verdict_]) + "\n" + fp64_note(v.stats.arbiter if v.stats else None),
        models=[model(v, loosened_, common)] if (paths.trial(v.name) / paths.TRIAL_CHECKPOINT).is_file() else [],
    )


def model(v: Variant, loosened_: list[str], common: Mapping[str, str]) -> ModelSpec:
    """The variant's trained checkpoint, named and tagged as its run, so that a query finds "the accepted bfloat16
    model" (``tags.variant = 'bfloat16' AND tags.decision = 'accept'``); the rule as params, the key figures linked."""
    return ModelSpec(
        name=f"{v.decision.decision.upper()} {v.name}",
        files=[paths.trial(v.name) / paths.TRIAL_CHECKPOINT],
        tags=child_tags(v, loosened_, common),
        params=flatten(v.decision.rule),
        metrics={k: x for k, x in columns(v).items() if k in KEY_COLUMNS},
    )


def child_tags(v: Variant, loosened_: list[str], common: Mapping[str, str]) -> dict[str, str]:
    """The decision and where it ran, as tags a reviewer filters the runs table by."""
    decision, checked = v.decision, v.diagnosis.forecast
    return {
        **common, **env_tags(v.manifest.env), "stage": "variant", "variant": v.name, "dtype": decision.dtype,
        "decision": decision.decision, "decision.inference": decision.inference, "decision.training": decision.training,
        "reasons_count": str(len(decision.reasons)), "benchmarked": str(v.benchmark.benchmarked).lower(),
        "gradscaler": "on" if v.stats is not None and v.stats.training.scaler_enabled else "off (no GradScaler)",
        # the rule itself, so that a later accept under a looser rule is flagged by publish
        **({"rule_json": json.dumps(decision.rule, sort_keys=True)} if decision.rule else {}),
        **({"rule_loosened": "true"} if loosened_ else {}),
        # supported, unsupported (flagged) or not a precision claim; no audit: the trial failed under its policy
        "amp_engaged": v.audit.speedup_claim if v.audit else "trial failed",
        **({"fp16_forecast": checked.recommendation, "fp16_forecast_held": str(checked.held).lower()} if checked else {}),
    }


def child_artifacts(d: str) -> list[tuple[Path, str]]:
    """The files of one variant's run: figures, the decision, the suggestion, the rollback package, stage JSON."""
    artifacts = [(paths.report_plot(d, name), "plots") for name, _ in page.PLOTS if paths.report_plot(d, name).is_file()]
    artifacts.append((paths.decision(d) / "decision.json", ""))
    suggested = paths.diagnose(d) / "suggested_params.yaml"
    if suggested.is_file():
        artifacts.append((suggested, ""))
    artifacts += [(p, "rollback") for p in sorted((paths.decision(d) / "rollback").glob("*")) if p.is_file()]
    for stage, folder in (
        ("trial", paths.trial(d)), ("compare", paths.compare(d)), ("diagnose", paths.diagnose(d)),
        ("benchmark", paths.benchmark(d)),
    ):
        artifacts += [(p, f"stages/{stage}") for p in sorted(folder.glob("*.json")) if p.name != "cases.json"]
    return artifacts


def columns(v: Variant) -> dict:
    """The runs table's columns for one variant: decision, flips, gaps, quality, training, speed and memory (a failed
    trial has the decision's alone)."""
    out = {
        "accepted": v.decision.accepted, "reasons": len(v.decision.reasons),
        **(_stats_columns(v.stats) if v.stats is not None else {}),
        "amp_engaged_share": v.audit.total.reduced_share if v.audit else None,
    }
    if v.stats is not None and (d := v.stats.distribution) is not None:  # per-token outputs (language models)
        out |= {"kl_mean": d.kl_mean, "kl_p99": d.kl_p99, "top1_agreement": d.top1_agreement}
    for name, arbiter in ((v.stats.arbiter if v.stats else None) or {}).items():  # renamed: see fp64_note
        out[f"fp64_check.{name}.amp_error_over_fp32_error"] = arbiter.amp_over_fp32
    if v.benchmark.benchmarked:
        out.update(_bench_columns(v.benchmark))
    return {k: x for k, x in out.items() if x is not None}


def _stats_columns(stats: Stats) -> dict:
    """Flips, gaps, quality and training, in the runs table's order."""
    flips, training, quality, values = stats.flips, stats.training, stats.quality, stats.values.values()
    return {
        "flips": flips.flips,
        "near_boundary_flips": flips.near_boundary_flips,
        "boundary_flips": flips.boundary_flips,
        "max_abs_gap": max((x.max_abs for x in values), default=None),
        "failing_fraction": max((x.failing_fraction for x in values), default=None),
        "quality_reference": quality.reference,
        "quality_trial": quality.trial,
        "quality_trained": quality.trained,
        "max_loss_gap": training.max_loss_gap,
        "loss_band_violations": training.band_violations,
        "skipped_steps": training.skipped_steps,
        "real_updates": training.real_updates,
        "final_loss_scale": training.final_scale,
    }


def _bench_columns(bench: Benchmark) -> dict:
    """Speed and memory medians, in ms and MiB."""
    memory = bench.memory
    out = {
        "speedup_median": bench.speedup.median if bench.speedup else None,
        "memory_ratio_peak": memory.memory_ratio.median if memory.memory_ratio else None,
        "working_memory_ratio": memory.working_memory_ratio.median if memory.working_memory_ratio else None,
    }
    for arm in ("fp32", "amp", "tf32"):
        sec = (bench.seconds_per_step or {}).get(arm)
        if sec is not None:
            out[f"step_ms.{arm}"] = 1000 * sec.median
        for spreads, label in ((memory.peak_memory_bytes, "process_peak_mib"), (memory.working_memory_bytes, "working_mib")):
            if (b := spreads.get(arm)) is not None:
                out[f"{label}.{arm}"] = b.median / 2**20
    return out


def curves(
    ref_steps: Steps, steps: Steps, rule_: AcceptanceConfig, replicate_steps: Steps | None = None
) -> dict[str, list[tuple[int, float]]]:
    """Per-step histories: both losses, the AMP gap, the band the rule allows around FP32's loss, the trial's
    scale, gradient norm, skips and learning rate and, when the reference ran an FP32 replicate, its gap (the
    noise floor)."""
    ref = {s.step: s.loss for s in ref_steps}
    shared = [s for s in steps if s.step in ref]
    return {
        "loss_fp32": [(s.step, s.loss) for s in ref_steps],
        "loss_amp": [(s.step, s.loss) for s in steps],
        "loss_gap_abs": [(s.step, abs(s.loss - ref[s.step])) for s in shared],
        **({"loss_band": [(s.step, rule_.loss_band(ref[s.step])) for s in shared]} if rule_.has_loss_band else {}),
        "loss_scale": [(s.step, s.scale) for s in steps],
        "grad_norm": [(s.step, s.grad_norm) for s in steps],
        "skipped": [(s.step, float(s.skipped)) for s in steps],
        "lr": [(s.step, s.lr) for s in steps],
        **({"loss_noise_floor": [(s.step, abs(s.loss - ref[s.step])) for s in replicate_steps if s.step in ref]}
           if replicate_steps is not None else {}),
    }


def fp64_note(arbiter: Mapping[str, Arbiter] | None) -> str:
    """What the FP64 check (compare's ``Stats.arbiter``, per output) measures, beside its figure; that there was none,
    when none ran."""
    if not arbiter:
        return ("- No FP64 check: the reference has no FP64 re-run (reference.fp64_arbiter is 0, the model does not run "
                "in float64, or auto found it too large to copy in float64); the tolerances alone judged the outputs.")
    lines = []
    for name, a in arbiter.items():
        covered = f" (the fixed set's first {a.cases} cases: reference.fp64_arbiter)" if a.cases else ""
        lines.append(
            f"- FP64 check, output '{name}': against an FP64 re-run of the same inputs{covered}, AMP's RMS error is "
            f"{page.number(a.amp_rmse_vs_fp64)} and FP32's own is {page.number(a.fp32_rmse_vs_fp64)}: "
            f"AMP's error is x{page.number(a.amp_over_fp32)} FP32's rounding error. Large by nature "
            f"(float16 keeps 10 mantissa bits, bfloat16 7, float32 23); the tolerances decide, not this ratio."
        )
    return "\n".join(lines)


def env_tags(env: Mapping[str, Any]) -> dict[str, str]:
    """Where it ran: backend is cpu, cuda or rocm (torch calls a ROCm GPU `cuda`; the stage recorded which)."""
    return {
        "backend": env.get("backend", "unknown"),
        "device_name": env.get("device_name", "unknown"),
        "torch_version": env.get("torch", "unknown"),
    }

