"""Assemble the comparison of one trial against the reference from the pure numerics.

Pure: tensors and records in, the statistics (what decide reads), a flat metrics summary (what DVC
and MLflow show) and the per-case table out.
"""

from __future__ import annotations

import math

import torch

from pipeline import numerics
from pipeline.cases import Cases
from pipeline.config import AcceptanceConfig
from pipeline.task import primary


def compare(
    kind: str,
    rule: AcceptanceConfig,
    fixed: Cases,
    ref_out: dict[str, torch.Tensor],
    trial_out: dict[str, torch.Tensor],
    trained_out: dict[str, torch.Tensor],
    ref_steps: list[dict],
    trial_steps: list[dict],
    final_scale: float,
    fp64_out: dict[str, torch.Tensor] | None = None,
    scaler_enabled: bool = True,
) -> dict:
    values = {}
    for name in sorted(ref_out):
        tol = rule.tolerance(name)
        values[name] = numerics.value_gaps(ref_out[name], trial_out[name], tol.atol, tol.rtol)
        per_kind = {}
        for k in sorted(set(fixed.kinds)):
            idx = torch.tensor([i for i, kk in enumerate(fixed.kinds) if kk == k])
            g = numerics.value_gaps(ref_out[name][idx], trial_out[name][idx], tol.atol, tol.rtol)
            per_kind[k] = {key: g[key] for key in ("elements", "failing", "max_abs", "max_rel", "nonfinite_trial_only")}
        values[name]["per_kind"] = per_kind
    arbiter = None
    if fp64_out is not None:
        arbiter = {name: numerics.error_vs_arbiter(ref_out[name], trial_out[name], fp64_out[name]) for name in sorted(ref_out)}

    ref_p, trial_p, trained_p = primary(ref_out), primary(trial_out), primary(trained_out)
    if kind == "classification":
        flips = numerics.classification_flips(fixed.ids, fixed.kinds, ref_p, trial_p, rule.tie_rule, rule.boundary_margin)
    else:
        flips = numerics.regression_flips(fixed.ids, fixed.kinds, ref_p, trial_p, rule.threshold)
    idx, targets = fixed.targets()
    quality = {
        "metric": "accuracy" if kind == "classification" else "neg_rmse",
        "reference": numerics.quality(kind, ref_p[idx], targets, rule.tie_rule),
        "trial": numerics.quality(kind, trial_p[idx], targets, rule.tie_rule),
        "trained": numerics.quality(kind, trained_p[idx], targets, rule.tie_rule),
    }
    regression = None
    if kind == "regression":
        regression = {
            "reference": numerics.regression_errors(ref_p[idx], targets),
            "trial": numerics.regression_errors(trial_p[idx], targets),
            "trained": numerics.regression_errors(trained_p[idx], targets),
        }
    ref_loss = [s["loss"] for s in ref_steps]
    trial_loss = [s["loss"] for s in trial_steps]
    training = numerics.trajectory_gap(ref_loss, trial_loss, rule.loss_atol, rule.loss_rtol)
    training.update(
        numerics.update_health(
            [s["skipped"] for s in trial_steps],
            [s["scale"] for s in trial_steps] + [final_scale],
            [not math.isfinite(v) for v in trial_loss],
            rule.stall_window,
        )
    )
    training["scaler_enabled"] = scaler_enabled
    stats = {"values": values, "arbiter": arbiter, "flips": flips, "quality": quality, "regression": regression, "training": training}
    return stats


def summary(stats: dict) -> dict:
    """Flat numbers for `dvc metrics show` and MLflow."""
    out: dict[str, float | int] = {}
    for name, g in stats["values"].items():
        for key in ("max_abs", "p99_abs", "max_rel", "failing_fraction", "nonfinite_trial_only", "min_passing_atol"):
            out[f"values.{name}.{key}"] = g[key]
    if stats["arbiter"]:
        for name, a in stats["arbiter"].items():
            out[f"arbiter.{name}.amp_over_fp32"] = a["amp_over_fp32"]
    for key in ("flips", "boundary_flips", "boundary_cases"):
        out[f"decisions.{key}"] = stats["flips"][key]
    for key in ("reference", "trial", "trained"):
        out[f"quality.{key}"] = stats["quality"][key]
    for key in ("max_loss_gap", "band_violations", "skipped_fraction", "real_updates", "final_scale", "final_loss_reference", "final_loss_trial"):
        out[f"training.{key}"] = stats["training"][key]
    return out


def case_table(fixed: Cases, ref_out: dict[str, torch.Tensor], trial_out: dict[str, torch.Tensor], stats: dict) -> list[dict]:
    """One row per case: id, kind, reference vs trial primary output, largest gap, flipped or not."""
    flipped = {f["id"] for f in stats["flips"]["flip_list"]}
    ref_p, trial_p = primary(ref_out), primary(trial_out)
    rows = []
    for i, case_id in enumerate(fixed.ids):
        r = ref_p[i].reshape(-1)
        t = trial_p[i].reshape(-1)
        row = {
            "id": case_id,
            "kind": fixed.kinds[i],
            "max_abs_gap": float((t.double() - r.double()).abs().max()) if r.numel() else 0.0,
            "flipped": case_id in flipped,
        }
        if r.numel() > 1:
            row["reference_class"] = int(r.argmax())
            row["trial_class"] = int(t.argmax())
            top = r.topk(2).values
            row["reference_margin"] = float(top[0] - top[1])
        else:
            row["reference"] = float(r[0]) if r.numel() else math.nan
            row["trial"] = float(t[0]) if t.numel() else math.nan
        rows.append(row)
    return rows
