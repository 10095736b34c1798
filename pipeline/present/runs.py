"""What publish mirrors to MLflow, as data: one parent run per pipeline execution, one child run per variant.

Pure: the loaded stage outputs in (``pipeline.artifacts.variant``), ``tracking.RunSpec`` out; no MLflow, no
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
from typing import Any

from pipeline import paths, rule
from pipeline.artifacts.reference import Manifest
from pipeline.artifacts.steps import Steps
from pipeline.config import AcceptanceConfig, build
from pipeline.files import flatten
from pipeline.present import page, verdict
from pipeline.tracking import EarlierRule, ModelSpec, RunSpec

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
    tags = {
        "git_commit": commit, "mlflow.source.git.commit": commit, "rule_sha256": manifest.rule_sha256,
        "reference_run_key": manifest.run_key,
    }
    if dvc_experiment:
        tags["dvc_experiment"] = dvc_experiment
    return tags


def loosened(decision: Mapping[str, Any], earlier_rollbacks: Sequence[EarlierRule]) -> list[str]:
    """How the rule of an accept is looser than a rule under which this reference was rolled back before.

    ``earlier_rollbacks`` is what ``tracking.Publisher.earlier_rollbacks`` found.
    """
    if decision["decision"] != "accept" or "rule" not in decision:
        return []
    out: list[str] = []
    for earlier in earlier_rollbacks:
        out += [
            f"{d} (rolled back under rule {earlier.rule_sha256[:12]})"
            for d in rule.loosened(earlier.rule, build(AcceptanceConfig, decision["rule"], "decision.rule"))
        ]
    return out


def verdicts(variants: Mapping[str, Mapping[str, Any]], loosened_by_dtype: Mapping[str, list[str]]) -> list[verdict.Verdict]:
    """Every variant's verdict, with what publish alone knows: how the rule was loosened since a rollback."""
    return [
        verdict.verdict(d, v["decision"], v["stats"], v["diagnosis"], v["benchmark"], loosened_by_dtype.get(d, []), v["audit"])
        for d, v in variants.items()
    ]


def parent(
    manifest: Manifest, variants: Mapping[str, Mapping[str, Any]], verdicts_: Sequence[verdict.Verdict],
    ref_steps: Steps, common: Mapping[str, str], flat: dict, params_path: str,
) -> RunSpec:
    """The pipeline execution: the verdict block first (description, report.html), the reference, params."""
    reference = {"rule_sha256": manifest.rule_sha256, "run_key": manifest.run_key, "env": manifest.env, "cases": manifest.cases,
                 "roles": manifest.roles}  # the role table: the description and report.html show it
    images = {d: v["plots"] for d, v in variants.items()}
    summary = page.markdown(reference, list(variants.values()), verdicts_)
    suffix = " ".join(filter(None, [common.get("dvc_experiment"), common["git_commit"][:8]]))
    ref_metrics = {
        "reference.real_updates": manifest.real_updates, "reference.final_loss": ref_steps[-1].loss if ref_steps else None,
    }
    return RunSpec(
        name=run_name(verdicts_, suffix),
        tags={**common, **env_tags(manifest.env), "stage": "pipeline", "variants": ",".join(variants),
              **{f"decision.{d}": v["decision"]["decision"] for d, v in variants.items()},
              **{f"reasons_count.{d}": str(len(v["decision"]["reasons"])) for d, v in variants.items()}},
        params=flat,
        metrics={
            **ref_metrics,
            **{f"{d}.{k}": x for d, v in variants.items() for k, x in columns(v).items() if k in KEY_COLUMNS},
        },
        steps={"loss_fp32": [(s.step, s.loss) for s in ref_steps], "grad_norm_fp32": [(s.step, s.grad_norm) for s in ref_steps]},
        artifacts=[(p, "") for p in (Path(params_path), Path("dvc.lock")) if p.is_file()]
        + [(paths.REF_MANIFEST, "reference"), (paths.REF_TRAJECTORY, "reference")],
        # The report quotes benchmark timings: built here, not as a DVC output (those rerun byte for byte).
        texts={"report.html": page.html(reference, list(variants.values()), images, verdicts_), "summary.md": summary},
        note=summary,
        models=[ModelSpec(
            "reference float32", [paths.REF_CHECKPOINT],
            tags={**common, **env_tags(manifest.env), "stage": "reference", "dtype": "float32"},
            metrics=ref_metrics,  # the run's own names: linked to the model, not logged twice
        )] if paths.REF_CHECKPOINT.is_file() else [],
    )


def child(v: Mapping[str, Any], verdict_: verdict.Verdict, loosened_: list[str], ref_steps: Steps,
          replicate_steps: Steps | None, common: Mapping[str, str], flat: dict) -> RunSpec:
    """One variant: decision and key figures as columns, curves, figures, table, suggestion, rollback package."""
    d, decision = v["variant"], v["decision"]
    rule_ = decision.get("rule") or {}
    return RunSpec(
        name=f"{decision['decision'].upper()} {d}",
        tags=child_tags(v, loosened_, common),
        params=flat,
        metrics=columns(v),
        steps=curves(ref_steps, v["trajectory"].steps if v["trajectory"] else (),  # None: the trial failed under its policy
                     build(AcceptanceConfig, rule_, "decision.rule"), replicate_steps),
        artifacts=child_artifacts(d),
        # flipped cases first: the table opens on them, not after pages of unchanged cases
        tables={"cases.json": sorted(v["cases"], key=lambda r: not r.get("flipped"))} if v["cases"] is not None else {},
        note=verdict.markdown([verdict_]) + "\n" + fp64_note(v["stats"]),
        models=[model(v, loosened_, common)] if (paths.trial(d) / paths.TRIAL_CHECKPOINT).is_file() else [],
    )


def model(v: Mapping[str, Any], loosened_: list[str], common: Mapping[str, str]) -> ModelSpec:
    """The variant's trained checkpoint, named and tagged as its run, so that a query finds "the accepted bfloat16
    model" (``tags.variant = 'bfloat16' AND tags.decision = 'accept'``); the rule as params, the key figures linked."""
    d, decision = v["variant"], v["decision"]
    return ModelSpec(
        name=f"{decision['decision'].upper()} {d}",
        files=[paths.trial(d) / paths.TRIAL_CHECKPOINT],
        tags=child_tags(v, loosened_, common),
        params=flatten(decision.get("rule") or {}),
        metrics={k: x for k, x in columns(v).items() if k in KEY_COLUMNS},
    )


def child_tags(v: Mapping[str, Any], loosened_: list[str], common: Mapping[str, str]) -> dict[str, str]:
    """The decision and where it ran, as tags a reviewer filters the runs table by."""
    decision, bench = v["decision"], v["benchmark"]
    rule_ = decision.get("rule") or {}
    return {
        **common, **env_tags(v["manifest"]["env"]), "stage": "variant", "variant": v["variant"],
        "dtype": v["manifest"]["policy"]["dtype"], "decision": decision["decision"],
        **{f"decision.{part}": decision[part] for part in ("inference", "training") if part in decision},
        "reasons_count": str(len(decision["reasons"])), "benchmarked": str(bool(bench.get("benchmarked"))).lower(),
        "gradscaler": "on" if (v["stats"].get("training") or {}).get("scaler_enabled") else "off (no GradScaler)",
        # the rule itself, so that a later accept under a looser rule is flagged by publish
        **({"rule_json": json.dumps(rule_, sort_keys=True)} if rule_ else {}),
        **({"rule_loosened": "true"} if loosened_ else {}),
        # supported, unsupported (flagged) or not a precision claim; no audit: the trial failed under its policy
        "amp_engaged": v["audit"]["speedup_claim"] if v["audit"] else "trial failed",
        **({"fp16_forecast": v["diagnosis"]["forecast"]["recommendation"],
            "fp16_forecast_held": str(v["diagnosis"]["forecast"]["held"]).lower()} if v["diagnosis"].get("forecast") else {}),
        **{f"decision_tag.{k}": x for k, x in decision.get("tags", {}).items()},
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


def columns(v: Mapping[str, Any]) -> dict:
    """The runs table's columns for one variant: decision, flips, gaps, quality, training, speed and memory."""
    stats, bench = v["stats"], v["benchmark"]
    flips, training, quality = stats.get("flips") or {}, stats.get("training") or {}, stats.get("quality") or {}
    values = (stats.get("values") or {}).values()
    out = {
        "accepted": v["decision"]["decision"] == "accept",
        "reasons": len(v["decision"]["reasons"]),
        "flips": flips.get("flips"),
        "near_boundary_flips": flips.get("near_boundary_flips"),
        "boundary_flips": flips.get("boundary_flips"),
        "max_abs_gap": max((x["max_abs"] for x in values if "max_abs" in x), default=None),
        "failing_fraction": max((x["failing_fraction"] for x in values if "failing_fraction" in x), default=None),
        "quality_reference": quality.get("reference"),
        "quality_trial": quality.get("trial"),
        "quality_trained": quality.get("trained"),
        "max_loss_gap": training.get("max_loss_gap"),
        "loss_band_violations": training.get("band_violations"),
        "skipped_steps": training.get("skipped_steps"),
        "real_updates": training.get("real_updates"),
        "final_loss_scale": training.get("final_scale"),
        "amp_engaged_share": ((v["audit"] or {}).get("total") or {}).get("reduced_share"),
    }
    distribution = stats.get("distribution") or {}
    for key in ("kl_mean", "kl_p99", "top1_agreement"):  # per-token outputs (language models)
        if distribution.get(key) is not None:
            out[key] = distribution[key]
    for name, arbiter in (stats.get("arbiter") or {}).items():  # renamed: see fp64_note
        out[f"fp64_check.{name}.amp_error_over_fp32_error"] = arbiter.get("amp_over_fp32")
    if bench.get("benchmarked"):
        out.update(_bench_columns(bench))
    return {k: x for k, x in out.items() if x is not None}


def _bench_columns(bench: Mapping[str, Any]) -> dict:
    """Speed and memory medians, in ms and MiB."""
    def median(*keys: str):
        node = bench
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node

    out = {
        "speedup_median": median("speedup", "median"),
        "memory_ratio_peak": median("memory_ratio", "median"),
        "working_memory_ratio": median("working_memory_ratio", "median"),
    }
    for variant in ("fp32", "amp", "tf32"):
        sec = median("seconds_per_step", variant, "median")
        if sec is not None:
            out[f"step_ms.{variant}"] = 1000 * sec
        for field, label in (("peak_memory_bytes", "process_peak_mib"), ("working_memory_bytes", "working_mib")):
            b = median(field, variant, "median")
            if b is not None:
                out[f"{label}.{variant}"] = b / 2**20
    return out


def curves(
    ref_steps: Steps, steps: Steps, rule_: AcceptanceConfig, replicate_steps: Steps | None = None
) -> dict[str, list[tuple[int, float]]]:
    """Per-step histories: both losses, the AMP gap, the band the rule allows around FP32's loss, the trial's
    scale, gradient norm, skips and learning rate and, when the reference ran an FP32 replicate, its gap (the
    noise floor)."""
    ref = {s.step: s.loss for s in ref_steps}
    shared = [s for s in steps if s.step in ref]
    out = {
        "loss_fp32": [(s.step, s.loss) for s in ref_steps],
        "loss_amp": [(s.step, s.loss) for s in steps],
        "loss_gap_abs": [(s.step, abs(s.loss - ref[s.step])) for s in shared],
        **({"loss_band": [(s.step, rule_.loss_band(ref[s.step])) for s in shared]} if rule_.has_loss_band else {}),
        "loss_scale": [(s.step, s.scale) for s in steps],
        "grad_norm": [(s.step, s.grad_norm) for s in steps],
        "skipped": [(s.step, float(s.skipped)) for s in steps],
        "lr": [(s.step, s.lr) for s in steps],
    }
    if replicate_steps is not None:
        out["loss_noise_floor"] = [(s.step, abs(s.loss - ref[s.step])) for s in replicate_steps if s.step in ref]
    return out


def fp64_note(stats: Mapping[str, Any]) -> str:
    """What the FP64 check (compare's "arbiter") measures, beside its figure; that there was none, when none ran."""
    if not stats.get("arbiter"):
        return ("- No FP64 check: the reference has no FP64 re-run (reference.fp64_arbiter is 0, the model does not run "
                "in float64, or auto found it too large to copy in float64); the tolerances alone judged the outputs.")
    lines = []
    for name, a in (stats.get("arbiter") or {}).items():
        covered = f" (the fixed set's first {a['cases']} cases: reference.fp64_arbiter)" if a.get("cases") else ""
        lines.append(
            f"- FP64 check, output '{name}': against an FP64 re-run of the same inputs{covered}, AMP's RMS error is "
            f"{page.number(a.get('amp_rmse_vs_fp64'))} and FP32's own is {page.number(a.get('fp32_rmse_vs_fp64'))}: "
            f"AMP's error is x{page.number(a.get('amp_over_fp32'))} FP32's rounding error. Large by nature "
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

