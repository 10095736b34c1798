"""The training side of the comparison: the trial's loss trajectory against the reference's, and its updates' health.

Plain sequences in (one loss per step; skips, scales, non-finite flags), the typed sections of
``artifacts.comparison`` out (``LossGap``, ``UpdateHealth``, ``FinalLoss``, ``UpdatesToLoss``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pipeline.artifacts.comparison import FinalLoss, LossGap, Noise, UpdateHealth, UpdatesToLoss

FINAL_SHARE = 0.1
"""The share of a run's last steps whose mean loss is its final loss (at least one step): one step's loss is one batch's,
whose noise would swamp where the training ended."""


def final_loss(trial: Sequence[float], fp32: Sequence[Sequence[float]]) -> FinalLoss:
    """The mean loss over the last ``FINAL_SHARE`` of the steps of the trial and of each FP32 run (the reference first,
    then its replicates). A non-finite loss there makes that run's final loss infinite (no band holds it)."""
    window = max(1, math.ceil(FINAL_SHARE * len(trial)))

    def last(losses: Sequence[float]) -> float:
        tail = [float(v) for v in losses[-window:]]
        return sum(tail) / len(tail) if tail and all(math.isfinite(v) for v in tail) else math.inf

    return FinalLoss(window=window, amp=last(trial), fp32=tuple(last(run) for run in fp32))


Run = tuple[Sequence[float], Sequence[bool]]
"""One run's losses and skip flags, step by step."""


def reach_step(losses: Sequence[float], target: float, window: int) -> int | None:
    """The first step at which the mean loss of the ``window`` steps up to it (a full window, averaged as ``final_loss``
    averages the last ones: at a run's last step it IS its final loss) is at or below ``target``; None when none is. A
    non-finite loss keeps every window that holds it out."""
    values = [float(v) for v in losses]
    bad = [0]  # non-finite losses before each step, so that a window's finiteness is one subtraction
    for v in values:
        bad.append(bad[-1] + (not math.isfinite(v)))
    for end in range(window, len(values) + 1):
        if bad[end] == bad[end - window]:
            tail = values[end - window:end]
            if sum(tail) / len(tail) <= target:
                return end - 1
    return None


def updates_to_loss(losses: Sequence[float], skipped: Sequence[bool], target: float, window: int) -> int | None:
    """The real updates a run made through the first step whose smoothed loss (``reach_step``) is at or below
    ``target``: its skipped steps are no real update. None when it never gets there."""
    if len(skipped) != len(losses):
        raise ValueError(f"{len(losses)} losses but {len(skipped)} skip flags")
    step = reach_step(losses, target, window)
    return None if step is None else sum(not s for s in skipped[:step + 1])


def updates_to_fp32_loss(trial: Run, reference: Run, replicates: Sequence[Run] = ()) -> UpdatesToLoss | None:
    """The real updates the trial, the reference and each FP32 replicate needed to reach FP32's final loss (the
    reference's ``final_loss``, over the trial's window). The replicates' counts, each on its own data order, are how
    far FP32 itself moves. None where the reference's final loss is not finite: there is nothing to reach."""
    final = final_loss(trial[0], [reference[0]])
    target, window = final.fp32[0], final.window
    if not math.isfinite(target):
        return None
    step = reach_step(trial[0], target, window)
    return UpdatesToLoss(
        target=target,
        window=window,
        of=sum(not s for s in trial[1]),
        amp=updates_to_loss(*trial, target, window),
        amp_steps=None if step is None else step + 1,
        fp32=updates_to_loss(*reference, target, window),
        fp32_replicates=tuple(updates_to_loss(*run, target, window) for run in replicates),
    )


def trajectory_gap(
    ref_loss: Sequence[float],
    trial_loss: Sequence[float],
    atol: float | None,
    rtol: float | None,
    replicate_loss: Sequence[float] | None = None,
    noise_multiple: float | None = None,
    noise_atol: float | None = None,
    replicate_of: Sequence[float] | None = None,
    excused: Sequence[bool] | None = None,
    more_replicates: Sequence[Sequence[float]] = (),
) -> LossGap:
    """Per-step loss band |trial - ref| <= atol + rtol * |ref|; non-finite trial losses violate it. With ``atol`` and
    ``rtol`` both None there is no fixed band (no step violates one); a None beside a number counts 0.

    With a replicate trajectory (FP32 again under a harmless change of the data order: FP32's own run-to-run
    variation), also the noise floor: per step the replicate's gap beside AMP's, and, when ``noise_multiple``
    is set, the band on the curves: AMP's mean gap and its largest gap each at most ``noise_multiple`` times
    the replicate's, plus ``noise_atol``. ``replicate_of``: the run the replicate repeats, against which its
    gap is FP32's noise (default ``ref_loss``; the reference itself when ``ref_loss`` is the skip-aligned FP32 run,
    whose difference from the reference is the trial's skips, not noise). ``excused``: steps not measured (a
    non-finite loss whose update the GradScaler skipped: an incident, judged by the skip limits, not by the band).
    ``more_replicates``: further FP32 replicates; the noise floor's mean gap is then their mean gaps' average, its largest
    gap the largest of theirs (one run's largest gap is heavy-tailed: averaged, it rolled back FP32 against itself), and
    the per-step ``replicate_gap`` stays the first's.
    """
    if len(ref_loss) != len(trial_loss):
        raise ValueError(f"trajectories differ in length: {len(ref_loss)} vs {len(trial_loss)}")
    r = torch.tensor([float(v) for v in ref_loss], dtype=torch.float64)
    t = torch.tensor([float(v) for v in trial_loss], dtype=torch.float64)
    # A non-finite loss on EITHER side is outside any band: a NaN reference step must not pass by comparison.
    gap = torch.where(torch.isfinite(t) & torch.isfinite(r), (t - r).abs(), torch.full_like(t, math.inf))
    spared = torch.tensor([bool(v) for v in (excused if excused is not None else [False] * len(t))], dtype=torch.bool)
    gap = torch.where(spared & torch.isfinite(r), torch.zeros_like(gap), gap)
    if atol is None and rtol is None:  # no fixed band: the noise floor alone judges the curve
        bad = torch.zeros_like(gap, dtype=torch.bool)
    else:  # NaN (a non-finite reference step) is outside the band too
        bad = ~(gap - ((atol or 0.0) + (rtol or 0.0) * r.abs()) <= 0)
    violations = int(bad.sum())
    first = int(torch.nonzero(bad).flatten()[0]) if violations else -1
    worst_step = int(gap.argmax()) if gap.numel() else -1
    noise = None
    if replicate_loss is not None:
        if len(replicate_loss) != len(ref_loss):
            raise ValueError(f"replicate trajectory has {len(replicate_loss)} steps, the reference {len(ref_loss)}")
        if replicate_of is not None and len(replicate_of) != len(ref_loss):
            raise ValueError(f"replicate_of has {len(replicate_of)} steps, the reference {len(ref_loss)}")
        base = r if replicate_of is None else torch.tensor([float(v) for v in replicate_of], dtype=torch.float64)
        noise = _noise(gap, base, [replicate_loss, *more_replicates], noise_multiple, noise_atol)
    return LossGap(
        steps=len(ref_loss),
        band_violations=violations,
        first_violation_step=first,
        max_loss_gap=float(gap[worst_step]) if gap.numel() else 0.0,
        max_loss_gap_step=worst_step,
        final_loss_reference=float(r[-1]) if r.numel() else math.nan,
        final_loss_trial=float(t[-1]) if t.numel() else math.nan,
        noise=noise,
        excused_steps=tuple(int(i) for i in torch.nonzero(spared).flatten().tolist()),
    )


def _noise(gap: torch.Tensor, r: torch.Tensor, replicates: Sequence[Sequence[float]], multiple: float | None,
           atol: float | None) -> Noise:
    """AMP's per-step ``gap`` beside the replicates', and the band on the curves when ``multiple`` or ``atol`` is set."""
    gaps = []
    for losses in replicates:
        rep = torch.tensor([float(v) for v in losses], dtype=torch.float64)
        gaps.append(torch.where(torch.isfinite(rep), (rep - r).abs(), torch.full_like(rep, math.inf)))
    noise = gaps[0]
    max_rep = max(float(g.max()) for g in gaps) if noise.numel() else 0.0  # one run's largest gap is heavy-tailed
    means = [float(g.mean()) for g in gaps] if noise.numel() else []
    m_rep = sum(means) / len(means) if means else 0.0
    stated, needed = multiple, fp32_multiple(means)
    if multiple is not None and needed is not None and needed > multiple:
        multiple = needed  # FP32 against itself needs more: the floor is calibrated on it, and the verdict says so
    m_amp = float(gap.mean()) if gap.numel() else 0.0
    max_amp = float(gap.max()) if gap.numel() else 0.0
    # Curve-level, as Megatron gates on loss-curve area: one replicate's per-step gap crosses zero by chance,
    # so the band compares the curves' mean gap (area) and their largest gap, not step by step.
    mean_ratio = m_amp / m_rep if m_rep > 0 else (math.inf if m_amp > 0 else 0.0)
    violations, first, over = 0, -1, None
    if multiple is not None or atol is not None:
        k, a = multiple or 0.0, atol or 0.0
        over_mean = not m_amp <= k * m_rep + a
        over_max = not max_amp <= k * max_rep + a
        violations = int(over_mean) + int(over_max)
        over = tuple(name for name, bad in (("mean", over_mean), ("max", over_max)) if bad)
        first = int(gap.argmax()) if violations else -1
    return Noise(replicate_gap=tuple(noise.tolist()), amp_gap=tuple(gap.tolist()), max_replicate_gap=max_rep,
                 mean_replicate_gap=m_rep, mean_amp_gap=m_amp, max_amp_gap=max_amp, multiple=multiple, atol=atol,
                 violations=violations, first_violation_step=first, worst_ratio=mean_ratio, mean_ratio=mean_ratio,
                 over=over, stated_multiple=stated if multiple != stated else None)


def fp32_multiple(means: Sequence[float]) -> float | None:
    """The multiple FP32 itself needs against its own noise floor (its A/A): each replicate's mean gap to the reference
    against the others' average, the largest such ratio; None with fewer than two replicates. The noise floor takes the
    larger of it and ``loss_noise_multiple``: a floor FP32 fails cannot tell precision from noise (two replicates of
    the overflow example at 12 updates differ 5.2x)."""
    ratios = []
    for k, own in enumerate(means):
        others = [m for i, m in enumerate(means) if i != k]
        floor = sum(others) / len(others) if others else 0.0
        if floor > 0 and math.isfinite(own):
            ratios.append(own / floor)
    return max(ratios) if len(means) >= 2 and ratios else None


def update_health(skipped: Sequence[bool], scales: Sequence[float], nonfinite_loss: Sequence[bool], window: int,
                  nonfinite_grad: Sequence[bool] | None = None, calibration: int = 0) -> UpdateHealth:
    """Skipped fraction, skips and whether real updates stopped in the last ``window`` steps, final scale, and the steps
    whose gradient norm was not finite WITHOUT a GradScaler to skip them (bfloat16, FP32): not applied, listed.

    ``calibration``: the skips that open the run (``calibration_steps``); the fraction and the last window count the skips
    after them; the stall check and the final scale still see every step."""
    n = len(skipped)
    window = min(window, n)  # a run shorter than the window stalls when none of its steps made a real update
    opening = next((i for i, skip in enumerate(skipped) if not skip), n) if calibration else 0  # the calibration's steps
    tail = list(skipped[max(n - window, opening):]) if n else []
    first_nonfinite = next((i for i, bad in enumerate(nonfinite_loss) if bad), -1)
    bad_grads = [i for i, bad in enumerate(nonfinite_grad or []) if bad]
    after = int(sum(skipped)) - calibration
    return UpdateHealth(
        nonfinite_grad_steps=tuple(bad_grads),
        skipped_steps=int(sum(skipped)),
        skipped_fraction=after / (n - calibration) if n > calibration else 0.0,
        recent_skipped_steps=int(sum(tail)),
        real_updates=n - int(sum(skipped)),
        stalled=bool(n and all(skipped[-window:])),
        stall_window=window,
        final_scale=scales[-1] if scales else 1.0,
        min_scale=min(scales) if scales else 1.0,
        first_nonfinite_loss_step=first_nonfinite,
        calibration_steps=calibration,
    )


def calibration_steps(skipped: Sequence[bool], nonfinite_loss: Sequence[bool]) -> int:
    """How many skips of a GradScaler run, each at a finite loss, open it before a real update follows: its calibration,
    the scale starting high and halving until the scaled gradients fit (PyTorch's AMP docs: the scale « often causes
    infs/NaNs to appear in gradients for the first few iterations as its value calibrates »). 0 when no real update
    follows (a run that never updated calibrated nothing). A forward overflow among the opening skips (a loss not
    finite: no scale too high) is no part of it, nor does it end it: an incident of its own, which the rule judges as
    one (``rule._training``: one is an incident, more are not)."""
    count = next((i for i, skip in enumerate(skipped) if not skip), len(skipped))
    return sum(not bad for bad in nonfinite_loss[:count]) if count < len(skipped) else 0
