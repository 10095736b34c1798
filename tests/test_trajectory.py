"""The training side: the loss band per step, the noise floor on the curves, and the health of the updates."""

import math

import pytest

from pipeline.compare.trajectory import (final_loss, reach_step, trajectory_gap, update_health, updates_to_fp32_loss,
                                         updates_to_loss)


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



# --- updates to reach FP32's final loss (issue 48, item 3) ----------------------------------------------------------


def test_updates_to_a_loss_count_the_first_smoothed_crossing_in_real_updates():
    losses = [4.0, 3.0, 2.0, 1.0, 1.0, 1.0]
    assert updates_to_loss(losses, [False] * 6, 1.0, window=1) == 4  # step 3, the 4th update
    # Smoothed as the final loss is: the mean of the 2 steps up to each one reaches 1.0 only at step 4.
    assert reach_step(losses, 1.0, 2) == 4 and updates_to_loss(losses, [False] * 6, 1.0, 2) == 5
    # One noisy batch under the target does not reach it: its window's mean is above.
    noisy = [4.0, 0.5, 3.0, 2.0, 1.0, 1.0]
    assert reach_step(noisy, 1.0, 1) == 1 and reach_step(noisy, 1.0, 2) == 5
    # A skipped update is no real update: two skips before the crossing leave 2 of its 4 steps.
    assert updates_to_loss(losses, [True, False, True, False, False, False], 1.0, 1) == 2
    # Never: None; a non-finite loss keeps its windows out.
    assert updates_to_loss(losses, [False] * 6, 0.5, 1) is None
    assert reach_step([4.0, math.inf, 0.5, 0.5], 1.0, 2) == 3
    with pytest.raises(ValueError, match="skip flags"):
        updates_to_loss(losses, [False], 1.0, 1)


def test_the_reference_reaches_its_own_final_loss_at_its_end_at_the_latest():
    ref = [3.0 - 0.01 * i for i in range(100)]  # falling to the end: its smoothed curve gets there at the last step
    assert final_loss(ref, [ref]).window == 10 and updates_to_loss(ref, [False] * 100, final_loss(ref, [ref]).amp, 10) == 100


def test_updates_to_fp32_loss_for_the_trial_and_each_replicate():
    n = 20  # window 2
    ref = [2.0 - 0.05 * i for i in range(n)]  # final loss: mean of 1.10 and 1.05 = 1.075
    slow = [2.0 - 0.04 * i for i in range(n)]  # never below 1.24
    fast = [2.0 - 0.1 * i for i in range(n)]  # mean of steps 8 and 9: 1.15; of 9 and 10: 1.05 -> step 10
    skips = [True, True] + [False] * (n - 2)
    r = updates_to_fp32_loss((fast, skips), (ref, [False] * n), [(slow, [False] * n), (ref, [False] * n)])
    assert r.target == pytest.approx(1.075) and r.window == 2 and r.of == n - 2
    assert (r.amp, r.amp_steps, r.fp32, r.fp32_replicates) == (9, 11, n, (None, n))  # 11 steps, 2 of them skipped
    assert updates_to_fp32_loss((slow, [False] * n), (ref, [False] * n)).amp is None
    assert updates_to_fp32_loss((fast, skips), (ref[:-1] + [math.nan], [False] * n)) is None  # nothing to reach


def test_compare_records_the_updates_to_fp32s_final_loss_against_the_reference_not_the_aligned_run():
    from _steps import step
    from pipeline.artifacts.comparison import Training
    from pipeline.compare.streams import Trajectories, training_stats
    from pipeline.config import AcceptanceConfig

    losses = [5.0 - 0.2 * i for i in range(12)]  # window 2: FP32's final loss 2.9
    reference = [step(i, v) for i, v in enumerate(losses)]
    replicate = [step(i, v + 0.01 * (-1) ** i) for i, v in enumerate(losses)]
    aligned = [step(i, v + (0.3 if i else 0.0)) for i, v in enumerate(losses)]
    trial = [step(i, v - 0.2, skipped=i == 0) for i, v in enumerate(losses)]  # one step ahead, its first update skipped
    t = training_stats(AcceptanceConfig(), Trajectories(reference, trial, 1024.0, True, replicate, aligned))
    reach = t.updates_to_fp32_loss
    assert reach.target == pytest.approx(2.9) and (reach.amp, reach.amp_steps, reach.of) == (10, 11, 11)
    assert reach.fp32 == 12 and reach.fp32_replicates == (12,)
    assert Training.from_dict(t.as_dict()) == t and t.as_dict()["updates_to_fp32_loss"]["fp32_replicates"] == [12]
