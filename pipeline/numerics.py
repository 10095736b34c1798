"""Pure numerics of the comparison: value gaps, decisions, flips, quality, training trajectories.

No file I/O, no MLflow, no globals: tensors and plain values in, plain dicts out. Computations are in
float64 so that the statistics themselves add no rounding worth mentioning.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def value_gaps(ref: torch.Tensor, trial: torch.Tensor, atol: float, rtol: float) -> dict:
    """Element-wise gap of ``trial`` against ``ref``.

    An element fails where |trial - ref| > atol + rtol * |ref|, or where the trial is non-finite and
    the reference is not (NaN in both counts as agreement, and is reported). Reports max, mean and p99
    of absolute and relative error over finite pairs, and the smallest atol (at the given rtol) and
    rtol (at the given atol) that would have passed: reported, never applied.
    """
    if ref.shape != trial.shape:
        raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs trial {tuple(trial.shape)}")
    r = ref.detach().double().flatten()
    t = trial.detach().double().flatten()
    n = r.numel()
    finite_r, finite_t = torch.isfinite(r), torch.isfinite(t)
    both = finite_r & finite_t
    nonfinite_trial_only = int((finite_r & ~finite_t).sum())
    nonfinite_ref = int((~finite_r).sum())
    same_nonfinite = int((~finite_r & ~finite_t & ((r == t) | (torch.isnan(r) & torch.isnan(t)))).sum())
    abs_err = (t[both] - r[both]).abs()
    mag = r[both].abs()
    fails_finite = abs_err > atol + rtol * mag
    failing = int(fails_finite.sum()) + nonfinite_trial_only + (nonfinite_ref - same_nonfinite)
    nz = mag > 0
    rel_err = abs_err[nz] / mag[nz]
    need_atol = float((abs_err - rtol * mag).clamp(min=0).max()) if abs_err.numel() else 0.0
    zero_gap = abs_err[~nz]
    if bool((zero_gap > atol).any()):
        need_rtol = math.inf
    else:
        need_rtol = float(((abs_err[nz] - atol).clamp(min=0) / mag[nz]).max()) if nz.any() else 0.0
    if nonfinite_trial_only:
        need_atol = need_rtol = math.inf
    return {
        "elements": n,
        "failing": failing,
        "failing_fraction": failing / n if n else 0.0,
        "nonfinite_trial_only": nonfinite_trial_only,
        "nonfinite_reference": nonfinite_ref,
        "nonfinite_both": same_nonfinite,
        "max_abs": _max(abs_err),
        "mean_abs": _mean(abs_err),
        "p99_abs": quantile(abs_err, 0.99),
        "max_rel": _max(rel_err),
        "mean_rel": _mean(rel_err),
        "p99_rel": quantile(rel_err, 0.99),
        "atol": atol,
        "rtol": rtol,
        "min_passing_atol": need_atol,
        "min_passing_rtol": need_rtol,
    }


def quantile(values: torch.Tensor, q: float) -> float:
    """Nearest-rank quantile (no size limit, unlike torch.quantile); 0.0 for an empty tensor."""
    if values.numel() == 0:
        return 0.0
    ordered = values.flatten().sort().values
    rank = min(max(math.ceil(q * ordered.numel()) - 1, 0), ordered.numel() - 1)
    return float(ordered[rank])


def _max(v: torch.Tensor) -> float:
    return float(v.max()) if v.numel() else 0.0


def _mean(v: torch.Tensor) -> float:
    return float(v.mean()) if v.numel() else 0.0


def error_vs_arbiter(ref: torch.Tensor, trial: torch.Tensor, fp64: torch.Tensor) -> dict:
    """Dynamo-style check: how far AMP is from FP64, compared with how far FP32 is from FP64."""
    a = fp64.double().flatten()
    ref_err = (ref.double().flatten() - a).abs()
    amp_err = (trial.double().flatten() - a).abs()
    ref_rmse = float(ref_err.pow(2).mean().sqrt()) if a.numel() else 0.0
    amp_rmse = float(amp_err.pow(2).mean().sqrt()) if a.numel() else 0.0
    return {
        "fp32_rmse_vs_fp64": ref_rmse,
        "amp_rmse_vs_fp64": amp_rmse,
        "amp_over_fp32": amp_rmse / ref_rmse if ref_rmse > 0 else (math.inf if amp_rmse > 0 else 1.0),
    }


def decisions(scores: torch.Tensor, tie_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Class per row by argmax, and the top-2 margin.

    Tie rule: ``lowest_index`` takes the lowest class index among the maxima; ``tie_is_flip`` marks a
    tied row with -1, which never equals a reference class. A row with NaN decides -2 (no decision).
    """
    s = scores.detach().double()
    if s.ndim != 2 or s.shape[1] < 2:
        raise ValueError(f"classification needs scores of shape [N, C>=2], got {tuple(s.shape)}")
    top2 = s.topk(2, dim=1).values if s.shape[0] else s[:, :2]
    margin = top2[:, 0] - top2[:, 1]
    is_max = s == s.max(dim=1, keepdim=True).values
    labels = is_max.double().argmax(dim=1)  # first maximal index
    if tie_rule == "tie_is_flip":
        labels = torch.where(is_max.sum(dim=1) > 1, torch.full_like(labels, -1), labels)
    bad = torch.isnan(s).any(dim=1)
    labels = torch.where(bad, torch.full_like(labels, -2), labels)
    margin = torch.where(bad, torch.full_like(margin, math.nan), margin)
    return labels, margin


def classification_flips(
    ids: Sequence[str],
    kinds: Sequence[str],
    ref_scores: torch.Tensor,
    trial_scores: torch.Tensor,
    tie_rule: str,
    boundary_margin: float,
) -> dict:
    """Decision flips, counted apart for boundary cases (reference top-2 margin below ``boundary_margin``)."""
    ref_labels, ref_margin = decisions(ref_scores, tie_rule)
    trial_labels, trial_margin = decisions(trial_scores, tie_rule)
    boundary = ref_margin < boundary_margin
    flips = []
    for i in torch.nonzero(ref_labels != trial_labels).flatten().tolist():
        flips.append(
            {
                "id": ids[i],
                "kind": kinds[i],
                "boundary": bool(boundary[i]),
                "reference_class": int(ref_labels[i]),
                "trial_class": int(trial_labels[i]),
                "reference_margin": float(ref_margin[i]),
                "trial_margin": float(trial_margin[i]),
                "reference_scores": [float(v) for v in ref_scores[i]],
                "trial_scores": [float(v) for v in trial_scores[i]],
            }
        )
    n_boundary = int(boundary.sum())
    boundary_flips = sum(f["boundary"] for f in flips)
    return {
        "cases": len(ids),
        "boundary_cases": n_boundary,
        "flips": len(flips) - boundary_flips,
        "boundary_flips": boundary_flips,
        "boundary_flip_fraction": boundary_flips / n_boundary if n_boundary else 0.0,
        "flip_list": flips,
    }


def regression_flips(
    ids: Sequence[str], kinds: Sequence[str], ref: torch.Tensor, trial: torch.Tensor, threshold: float | None
) -> dict:
    """Cases whose output crosses the decision threshold between reference and trial."""
    flips = []
    if threshold is not None:
        r, t = ref.detach().double().reshape(ref.shape[0], -1)[:, 0], trial.detach().double().reshape(trial.shape[0], -1)[:, 0]
        crossed = (r >= threshold) != (t >= threshold)
        for i in torch.nonzero(crossed).flatten().tolist():
            flips.append({"id": ids[i], "kind": kinds[i], "boundary": False, "reference": float(r[i]), "trial": float(t[i])})
    return {"cases": len(ids), "boundary_cases": 0, "flips": len(flips), "boundary_flips": 0, "boundary_flip_fraction": 0.0, "flip_list": flips}


def accuracy(scores: torch.Tensor, targets: torch.Tensor, tie_rule: str) -> float:
    if targets.numel() == 0:
        return math.nan
    labels, _ = decisions(scores, tie_rule)
    return float((labels == targets.long()).double().mean())


def regression_errors(pred: torch.Tensor, targets: torch.Tensor, extreme_quantile: float = 0.1) -> dict:
    """MAE, RMSE, max error, and the error on the most extreme targets (top and bottom quantile)."""
    p = pred.detach().double().reshape(pred.shape[0], -1)[:, 0]
    y = targets.detach().double().reshape(targets.shape[0], -1)[:, 0]
    if y.numel() == 0:
        return {"mae": math.nan, "rmse": math.nan, "max_error": math.nan, "extreme_low_mae": math.nan, "extreme_high_mae": math.nan}
    err = (p - y).abs()
    k = max(1, int(math.ceil(extreme_quantile * y.numel())))
    order = y.argsort()
    return {
        "mae": float(err.mean()),
        "rmse": float(err.pow(2).mean().sqrt()),
        "max_error": float(err.max()),
        "extreme_low_mae": float(err[order[:k]].mean()),
        "extreme_high_mae": float(err[order[-k:]].mean()),
        "output_min": float(p.min()),
        "output_max": float(p.max()),
    }


def quality(kind: str, outputs: torch.Tensor, targets: torch.Tensor, tie_rule: str) -> float:
    """One number where higher is better: accuracy, or minus the RMSE for regression."""
    if kind == "classification":
        return accuracy(outputs, targets, tie_rule)
    return -regression_errors(outputs, targets)["rmse"]


def trajectory_gap(ref_loss: Sequence[float], trial_loss: Sequence[float], atol: float, rtol: float) -> dict:
    """Per-step loss band |trial - ref| <= atol + rtol * |ref|; non-finite trial losses violate it."""
    if len(ref_loss) != len(trial_loss):
        raise ValueError(f"trajectories differ in length: {len(ref_loss)} vs {len(trial_loss)}")
    violations, worst, worst_step, first = 0, 0.0, -1, -1
    for step, (r, t) in enumerate(zip(ref_loss, trial_loss)):
        gap = abs(t - r) if math.isfinite(t) else math.inf
        excess = gap - (atol + rtol * abs(r))
        if excess > 0:
            violations += 1
            first = step if first < 0 else first
        if gap > worst or worst_step < 0:
            worst, worst_step = gap, step
    return {
        "steps": len(ref_loss),
        "band_violations": violations,
        "first_violation_step": first,
        "max_loss_gap": worst,
        "max_loss_gap_step": worst_step,
        "final_loss_reference": ref_loss[-1] if ref_loss else math.nan,
        "final_loss_trial": trial_loss[-1] if trial_loss else math.nan,
    }


def update_health(skipped: Sequence[bool], scales: Sequence[float], nonfinite_loss: Sequence[bool], window: int) -> dict:
    """Skipped fraction, whether real updates stopped in the last ``window`` steps, final scale."""
    n = len(skipped)
    tail = list(skipped[-window:]) if n else []
    first_nonfinite = next((i for i, bad in enumerate(nonfinite_loss) if bad), -1)
    return {
        "skipped_steps": int(sum(skipped)),
        "skipped_fraction": sum(skipped) / n if n else 0.0,
        "real_updates": n - int(sum(skipped)),
        "stalled": bool(n >= window and all(tail)),
        "final_scale": scales[-1] if scales else 1.0,
        "min_scale": min(scales) if scales else 1.0,
        "first_nonfinite_loss_step": first_nonfinite,
    }
