"""The training side: the loss band per step, the noise floor on the curves, and the health of the updates."""

import math

import pytest

from pipeline.compare.trajectory import trajectory_gap, update_health


def test_trajectory_gap_band_and_nonfinite():
    g = trajectory_gap([2.0, 1.0, 0.5], [2.0, 1.2, math.nan], atol=0.05, rtol=0.1)
    assert g.band_violations == 2 and g.first_violation_step == 1
    assert g.max_loss_gap == math.inf
    ok = trajectory_gap([2.0, 1.0], [2.1, 1.05], atol=0.05, rtol=0.1)
    assert ok.band_violations == 0
    with pytest.raises(ValueError, match="differ in length"):
        trajectory_gap([1.0], [1.0, 1.0], 0.05, 0.1)


def test_noise_floor_band_is_on_the_curves():
    ref = [2.0, 1.5, 1.0]
    rep = [2.0, 1.51, 1.02]
    amp = [2.0, 1.53, 1.05]
    g = trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep, noise_multiple=2.0, noise_atol=0.0)
    n = g.noise
    assert n.replicate_gap == pytest.approx((0.0, 0.01, 0.02))
    # mean 0.0267 > 2 x 0.01 and largest 0.05 > 2 x 0.02: both curve statistics fail; the largest gap is at step 2
    assert n.violations == 2 and n.over == ("mean", "max") and n.first_violation_step == 2
    ok = trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep, noise_multiple=3.0, noise_atol=0.001)
    assert ok.noise.violations == 0
    # One replicate step that happens to match the reference does not fail a step-by-step band that it cannot measure.
    crossing = trajectory_gap(ref, [2.01, 1.52, 1.03], 1.0, 0.0, replicate_loss=[2.02, 1.5, 1.04], noise_multiple=3.0)
    assert crossing.noise.violations == 0
    assert trajectory_gap(ref, amp, 1.0, 0.0, replicate_loss=rep).noise.violations == 0  # no band set: none counted


def test_update_health_detects_stall_and_skips():
    h = update_health([False, True, True, True], [4.0, 2.0, 1.0, 0.5, 0.25], [False] * 4, window=3)
    assert h.stalled and h.skipped_steps == 3 and h.real_updates == 1
    assert h.final_scale == 0.25
    assert not update_health([True, False], [1.0, 1.0, 1.0], [False, False], window=2).stalled
    listed = update_health([False] * 3, [1.0] * 4, [False, True, False], window=2, nonfinite_grad=[False, True, True])
    assert listed.nonfinite_grad_steps == (1, 2) and listed.first_nonfinite_loss_step == 1


def test_noise_floor_is_the_replicate_against_the_run_it_repeats_not_the_skip_aligned_one():
    """The trial is held against FP32 aligned on its skips (designed skips are not precision), but FP32's noise is the
    replicate against the reference it repeats: measured against the aligned run, the skip's own effect (0.3 here)
    would count as noise and let an AMP run 30 times FP32's real noise (0.01) through."""

    from _steps import step
    from pipeline.compare.streams import Trajectories, training_stats
    from pipeline.config import AcceptanceConfig

    losses = [5.0 - 0.2 * i for i in range(12)]
    reference = [step(i, v) for i, v in enumerate(losses)]
    replicate = [step(i, v + 0.01 * (-1) ** i) for i, v in enumerate(losses)]
    aligned = [step(i, v + (0.3 if i else 0.0)) for i, v in enumerate(losses)]  # FP32 with the trial's step-0 skip
    off = [step(i, s.loss + (0.3 if i else 0.0), skipped=i == 0) for i, s in enumerate(aligned)]
    rule = AcceptanceConfig(loss_noise_multiple=3.0, loss_atol=0.05, loss_rtol=0.1)
    noise = training_stats(rule, Trajectories(reference, off, 1024.0, True, replicate, aligned)).noise
    assert noise.max_replicate_gap == pytest.approx(0.01)
    assert noise.violations == 2 and noise.over == ("mean", "max")
    # The same trial, AMP within FP32's noise of the aligned run: passes.
    close = [step(i, s.loss + 0.01 * (-1) ** i, skipped=i == 0) for i, s in enumerate(aligned)]
    assert training_stats(rule, Trajectories(reference, close, 1024.0, True, replicate, aligned)).noise.violations == 0
    with pytest.raises(ValueError, match="replicate_of"):
        trajectory_gap(losses, losses, 1.0, 0.0, replicate_loss=losses, replicate_of=losses[:3])

