"""present/runs.py: what publish mirrors to MLflow, as data (no server): the FP64 note and the per-step curves."""

from __future__ import annotations

from dataclasses import replace

from _steps import step

from pipeline.artifacts.comparison import Arbiter
from pipeline.config import AcceptanceConfig
from pipeline.present import runs

ARBITER = Arbiter(fp32_rmse_vs_fp64=1e-7, amp_rmse_vs_fp64=2e-4, amp_over_fp32=2000.0)


def test_the_fp64_note_says_what_the_check_covered_and_that_there_was_none():
    full = runs.fp64_note({"logits": ARBITER})
    assert "against an FP64 re-run of the same inputs, AMP's RMS error is 0.0002" in full and "first" not in full
    partial = runs.fp64_note({"logits": replace(ARBITER, cases=5)})
    assert "(the fixed set's first 5 cases: reference.fp64_arbiter)" in partial
    for absent in (None, {}):  # 0 cases, or a model that does not run in float64: said, not silent
        assert runs.fp64_note(absent).startswith("- No FP64 check: the reference has no FP64 re-run")


def test_curves_follow_the_steps_both_runs_share():
    ref = (step(0, 2.0), step(1, 1.0), step(2, 0.5))
    trial = (step(0, 2.5, scale=65536.0, skipped=True, lr=0.0), step(1, 1.5, scale=32768.0), step(3, 9.0))
    rule = AcceptanceConfig(loss_atol=0.1, loss_rtol=0.5)
    out = runs.curves(ref, trial, rule, replicate_steps=(step(1, 1.25), step(7, 0.0)))
    assert out["loss_gap_abs"] == [(0, 0.5), (1, 0.5)]  # step 3 has no FP32 loss to compare with
    assert out["loss_band"] == [(0, 0.1 + 0.5 * 2.0), (1, 0.1 + 0.5 * 1.0)]
    assert out["skipped"] == [(0, 1.0), (1, 0.0), (3, 0.0)] and out["lr"] == [(0, 0.0), (1, 0.1), (3, 0.1)]
    assert out["loss_scale"][:2] == [(0, 65536.0), (1, 32768.0)] and out["loss_noise_floor"] == [(1, 0.25)]
