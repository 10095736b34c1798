"""The acceptance rule applied to comparison statistics: accept, or roll back, with every reason.

Pure: typed statistics (``artifacts.comparison.Stats``) and the rule in, a ``RuleResult`` out. Every failed criterion
is a reason; a variant is accepted only when there is none. Passing criteria are listed as checks so a
reviewer sees what was verified, not only what failed.

What each criterion needs from the outputs (for very large vocabularies, where storing [N, T, C] scores
of both sides may be too much, this is what a reduced store would have to keep):
- ``outputs.*`` tolerances and ``max_failing_fraction``: every output element of both sides;
- ``max_flips``, ``max_near_boundary_flips``, ``max_boundary_flip_fraction``, ``min_top1_agreement``:
  per case / token, each side's argmax and the reference's top-2 scores (``boundary_margin_kind:
  probability`` also needs the reference's log-sum-exp; ``relative`` the spread of its scores);
- ``max_kl_mean``, ``max_kl_p99``: both full distributions per token (top-k logits plus log-sum-exp
  give only a bound: the probability mass outside the top k is known, its shape is not). The compact store
  (``artifacts.compact``, 2 bytes per entry) keeps every decision above exactly and KL within a stated bound;
  the gates below add that bound (0 for the full store);
- ``min_quality``, ``max_quality_drop``: the primary output on the cases with a target (accuracy and
  top-k need the argmax / top-k indices; perplexity the log-sum-exp and the target's logit);
- training criteria: the per-step trajectories only (and the FP32 replicate's for the noise floor).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipeline.present import verdict

from pipeline.artifacts.comparison import (Decisions, Distribution, FinalLoss, FP32Spread, Noise, Quality, Stats,
                                           Training)
from pipeline.compare import bounds
from pipeline import heads
from pipeline.config import AcceptanceConfig, Policy, Tolerance, metric_range
from pipeline.heads import primary_name
from pipeline.errors import UserError

if TYPE_CHECKING:  # the loop's record: training imports torch, the rule does not
    from pipeline.artifacts.audit import Audit  # read by attribute: the stages that pass one list its file
    from pipeline.artifacts.steps import StepRecord

Part = Literal["inference", "training"]
BOTH: tuple[Part, ...] = ("inference", "training")


@dataclass(frozen=True)
class RuleResult:
    """The rule's outcome on one trial: every failed criterion (``reasons``), every passed one (``checks``),
    the verdict of each part, and per failed criterion the ids of its cases (``steps``: training steps)."""

    reasons: tuple[str, ...]
    checks: tuple[str, ...]
    inference: Literal["accept", "rollback"]
    training: Literal["accept", "rollback", "not judged"]
    """``not judged``: nothing trained (``reference.train_steps`` 0, an inference-only verdict)."""
    cases: dict[str, tuple[str | int, ...]]

    @property
    def decision(self) -> Literal["accept", "rollback"]:
        return "rollback" if self.reasons else "accept"

    @property
    def accepted(self) -> bool:
        return not self.reasons


def _ids(ids, cap: int = 400) -> str:
    text = ", ".join(verdict.safe_id(i) for i in ids)  # printable, each capped: an id never forges a line
    return text if len(text) <= cap else text[:cap] + f"… ({len(ids)} listed)"


class _Judge:
    """Collects each criterion's outcome, in the part (inference or training) it belongs to."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.checks: list[str] = []
        self.failed = {"inference": False, "training": False}
        self.cases: dict[str, list] = {}

    def check(self, part: Part | tuple[Part, ...], ok: bool, passed: str, failed: str,
              cases: tuple[str, list] | None = None) -> None:
        if ok:
            self.checks.append(passed)
            return
        self.reasons.append(failed)
        for p in (part,) if isinstance(part, str) else part:
            self.failed[p] = True
        if cases is not None and cases[1]:
            kept = self.cases.setdefault(cases[0], [])
            seen = set(kept)
            kept.extend(x for x in dict.fromkeys(cases[1]) if x not in seen)  # in order, once each

    def result(self, trained: bool = True) -> RuleResult:
        inference, training = ("rollback" if self.failed[part] else "accept" for part in ("inference", "training"))
        training = training if trained else "not judged"
        return RuleResult(
            tuple(self.reasons), tuple(self.checks), inference, training, {k: tuple(v) for k, v in self.cases.items()}
        )


def decide(stats: Stats, acceptance: AcceptanceConfig, engaged: Audit | None = None) -> RuleResult:
    """Apply the rule ``acceptance`` to ``stats`` and to the trial's audit ``engaged`` (None: no audit, the AMP share
    not judged).

    Two decisions, then the overall one: ``inference`` (the trained reference run under the policy) and
    ``training`` (the model trained under the policy, its trajectory and its outputs). The diagnosis'
    findings are not the rule's: decide puts them beside this result."""
    j = _Judge()
    _inference(stats, acceptance, j)
    trained = stats.training.steps > 0
    if trained:
        _training(stats, acceptance, j)
    else:  # said, never silent: an inference-only verdict answers nothing about training in this precision
        j.checks.append(NOT_TRAINED)
    if engaged is not None:
        amp_share(engaged, acceptance, j)
    return j.result(trained)


NOT_TRAINED = ("training: not judged: reference.train_steps is 0 (an inference-only verdict: nothing trained, the rule's "
               "training criteria are not applied)")


def _pct(share: float) -> str:
    return f"{100 * share:.1f} %"


def amp_share(engaged: Audit, rule: AcceptanceConfig, j: _Judge | None = None) -> str | None:
    """AMP must have something to gain: a reduced-precision policy runs at least ``min_amp_share`` of the matmul,
    convolution and attention FLOPs in float16, bfloat16 or float8 beyond its FP32 reference's (the audit's pass).
    Below it, the variant is rolled back whatever its numerics: keeping FP32 is then the honest configuration. Both
    parts: inference and training ran under the same policy, and neither gains from reduced precision that does not
    engage. An FP32 policy (compile only) makes no precision claim: not judged. Returns the reason, or None when it
    passes; with ``j``, the outcome is recorded there too."""
    j = j or _Judge()
    if not engaged.expects_reduced:
        j.checks.append("amp: not judged: the policy runs FP32 by design (no autocast dtype, no float8), no precision claim")
        return None
    policy = Policy.from_dict(engaged.policy)
    how = f"float8 ({policy.float8})" if policy.float8 != "off" else f"autocast ({policy.dtype})"
    ref = engaged.reference_reduced_share or 0.0
    share = gained(engaged)
    words = (f"amp: {how} engaged on {_pct(share)} of the matmul/convolution/attention FLOPs"
             + (f" beyond the FP32 reference's {_pct(ref)}" if ref else ""))
    if not engaged.total.flops:
        words = "amp: no matmul/convolution/attention FLOPs were seen in the audited pass"
    if rule.min_amp_share is None:
        j.checks.append(f"{words}: not limited: the rule sets min_amp_share: null")
        return None
    minimum = f"minimum {100 * rule.min_amp_share:g} %"
    failed = f"{words} ({minimum}): nothing to gain; {_amp_fix(engaged, ref)}"
    ok = bool(engaged.total.flops) and share >= rule.min_amp_share
    j.check(BOTH, ok, f"{words} ({minimum})", failed)
    return None if ok else failed


def gained(engaged: Audit) -> float:
    """The share of the audited matmul, convolution and attention FLOPs in reduced precision beyond the FP32 reference's."""
    return (engaged.total.reduced_share or 0.0) - (engaged.reference_reduced_share or 0.0)


def reduced_dtype(policy: Policy) -> str:
    """What ``policy`` reduces its work to, in words: its float8 scaling, else its autocast dtype."""
    return f"float8 {policy.float8}" if policy.float8 != "off" else policy.dtype


def _amp_fix(engaged: Audit, ref: float) -> str:
    """What would give reduced precision work to do: the audit's largest FP32 share, by fp32_modules or not."""
    if ref:
        return ("the FP32 reference already runs that work in reduced precision (a model cast with .to()?): "
                "freeze a float32 reference")
    kept = sum(o.share for o in engaged.kept_fp32)
    stayed = sum(o.share for o in engaged.stayed_fp32)
    if engaged.kept_fp32 and kept >= stayed:
        modules = sorted({o.module for o in engaged.kept_fp32})
        return (f"the policy's fp32_modules keep {_pct(kept)} of it in FP32 ({', '.join(map(repr, modules[:8]))}"
                f"{', ...' if len(modules) > 8 else ''}): keep the FP32 reference, or trial fewer fp32_modules")
    if engaged.stayed_fp32:
        op = engaged.stayed_fp32[0]
        where = f"module {op.module!r}" if op.module else "the model's own forward"
        return (f"the largest op left in FP32 is {op.op} in {where} ({op.phase}, {_pct(op.share)}, {op.precision}): "
                f"outside autocast's op lists, under autocast(enabled=False) or in float64; make it run under the "
                f"policy, or keep the FP32 reference")
    return "the model has no matmul, convolution or attention work for reduced precision to speed up: keep FP32"


def _inference(stats: Stats, rule: AcceptanceConfig, j: _Judge) -> None:
    for name in stats.outputs.undecided or ():  # said, never failed: the user meant decisions, or did not
        j.check("inference", True, f"decisions '{name}': none judged: its role is values (inferred), though its targets are "
                f"labels 0 or 1; state acceptance.outputs.{name}.role: labels to decide each at a threshold", "")
    nonfinite_ids = stats.nonfinite.trial.ids
    for name, gap in sorted(stats.values.items()):
        count = gap.nonfinite_trial_only
        ids = nonfinite_ids if count else ()
        j.check("inference", count == 0, f"outputs '{name}': all finite",
                f"outputs '{name}': {count} non-finite element(s) where the reference is finite"
                + (f": {_ids(ids)}" if ids else ""),
                ("nonfinite_trial", ids))
        failing_ids = gap.failing_ids or ()
        j.check(
            "inference",
            gap.failing_fraction <= rule.max_failing_fraction,
            f"values '{name}': {gap.failing} of {gap.elements} elements outside atol={gap.atol} rtol={gap.rtol} "
            f"(allowed fraction {rule.max_failing_fraction})",
            f"values '{name}': {gap.failing} of {gap.elements} elements outside atol={gap.atol} rtol={gap.rtol}, "
            f"fraction {gap.failing_fraction:.4g} > allowed {rule.max_failing_fraction} "
            + (f"(max abs error {gap.max_abs:.4g}; would have needed atol >= {gap.min_passing_atol:.4g})"
               if math.isfinite(gap.min_passing_atol) else "(non-finite elements: no atol passes them)")
            + (f": {_ids(failing_ids)}" if failing_ids else ""),
            ("values", failing_ids),
        )
    _decisions(stats.flips, rule, j, "decisions", "flips")
    for name, head in sorted(stats.heads.items()):
        _decisions(head, rule, j, f"decisions '{name}'", f"flips {name}")
    _distribution(stats.distribution, rule, j, stats.flips)
    _quality(stats.quality, rule, j, "inference", "trial")


def _decisions(flips: Decisions, rule: AcceptanceConfig, j: _Judge, label: str, key: str) -> None:
    """Flips of real cases (ordinary, edge, selected: what the application acts on) and of constructed ones."""
    unit = flips.unit
    far_ids = flips.labels(boundary=False, near=False)
    near_ids = flips.labels(boundary=False, near=True)
    far, near = flips.flips, flips.near_boundary_flips
    margin = f"{flips.margin_kind or 'logit'} margin < {rule.boundary_margin:g}"
    if rule.max_flip_rate is not None:  # over the sample of independent draws: the ordinary cases (``rate_sample``)
        real, k = flips.sample, flips.sample_flips
        upper = bounds.binomial_upper(k, real, rule.confidence)
        needed = bounds.cases_needed(rule.max_flip_rate, rule.confidence)
        words = (f"{label}: {k} changed of {real} ordinary {unit}s (edge and selected cases' flips count, not their "
                 f"{unit}s); the {rule.confidence:g}-confidence upper bound of the rate is {upper:.4g} (Clopper–Pearson)")
        j.check(
            "inference", upper <= rule.max_flip_rate,
            f"{words} <= allowed {rule.max_flip_rate:g} (the rule tolerates a rate, not a count)"
            + (f": {_ids(far_ids + near_ids)}" if k else ""),
            f"{words} > allowed {rule.max_flip_rate:g}" + (f": {_ids(far_ids + near_ids)}" if k else "")
            + (
                f"; the set has {real} ordinary {unit}s and this bound needs at least {needed} to pass even with no change"
                if real < needed else ""
            ),
            (key, far_ids + near_ids),
        )
    else:
        j.check("inference", far <= rule.max_flips,
                f"{label}: {far} flip(s) among real {unit}s away from the boundary (allowed {rule.max_flips})"
                + (f": {_ids(far_ids)}" if far else ""),
                f"{label}: {far} flip(s) among real {unit}s away from the boundary > allowed {rule.max_flips}: {_ids(far_ids)}",
                (key, far_ids))
        near_cases = flips.near_boundary_cases
        if rule.max_near_boundary_flips is None:  # the user's explicit choice, said in words; never silent
            j.checks.append(f"{label}: {near} flip(s) among {near_cases} real {unit}s near the boundary ({margin}), "
                            f"not limited: the rule sets max_near_boundary_flips: null" + (f": {_ids(near_ids)}" if near else ""))
        else:
            j.check("inference", near <= rule.max_near_boundary_flips,
                    f"{label}: {near} flip(s) among {near_cases} real {unit}s near the boundary "
                    f"({margin}; allowed {rule.max_near_boundary_flips})"
                    + (f": {_ids(near_ids)}" if near else ""),
                    f"{label}: {near} flip(s) among {near_cases} real {unit}s near the boundary ({margin}) > allowed "
                    f"{rule.max_near_boundary_flips}: {_ids(near_ids)}",
                    (key, near_ids))
    built_ids = flips.labels(boundary=True)
    j.check("inference", flips.boundary_flip_fraction <= rule.max_boundary_flip_fraction,
            f"{label}: {flips.boundary_flips} of {flips.boundary_cases} constructed boundary cases flipped "
            f"(allowed fraction {rule.max_boundary_flip_fraction})",
            f"{label}: {flips.boundary_flips} of {flips.boundary_cases} constructed boundary cases flipped, "
            f"fraction {flips.boundary_flip_fraction:.3g} > allowed {rule.max_boundary_flip_fraction}: {_ids(built_ids)}",
            ("boundary_flips" if key == "flips" else f"boundary_{key}", built_ids))


NO_TARGET = ("no case of the fixed set carries a target (or every target is ignored), so the rule's quality criteria "
             "cannot be applied; give eval targets, or set acceptance.max_quality_drop: null and min_quality: null to "
             "judge without quality")


def _quality(quality: Quality, rule: AcceptanceConfig, j: _Judge, part: Part, side: Literal["trial", "trained"]) -> None:
    """Quality of ``side`` against the reference on the same cases: counts where the metric has them."""
    label = "inference" if side == "trial" else "after training"
    ref_q, q = quality.reference, quality.of(side)
    judged = rule.judges_quality
    if not math.isfinite(ref_q):  # no ordinary case or token carries a target
        if not judged:
            j.checks.append(f"quality {label}: not judged: the rule sets max_quality_drop: null and min_quality: null")
            return
        j.check(part, False, "", f"quality {label}: {NO_TARGET}")
        return
    if not math.isfinite(q):
        j.check(part, False, "", f"quality {label}: not finite")
        return
    higher = quality.higher_is_better
    if rule.max_quality_drop is not None:
        # After training, FP32 trained again lands elsewhere too: the drop allowed is the rule's or FP32's own, the larger.
        spread = quality.fp32_spread if side == "trained" else None
        max_drop, fp32 = rule.max_quality_drop, ""
        if spread is not None:
            own = bounds.fp32_drop_allowed(spread.reference, list(spread.replicates), training_confidence(rule), higher)
            max_drop = max(max_drop, own)
            fp32 = (f" [FP32's own spread: its replicate {', '.join(f'{v:.4g}' for v in spread.replicates)} vs reference "
                    f"{spread.reference:.4g}, an FP32 retraining may drop {own:.4g} at confidence {training_confidence(rule):g}; "
                    f"allowed the larger of that and max_quality_drop {rule.max_quality_drop:g}]")
        if side in quality.counts and "reference" in quality.counts:
            (hits_r, n), (hits, _) = quality.counts["reference"], quality.counts[side]
            lost = hits_r - hits
            allowed = max_drop * n
            paired = quality.paired.get(side)
            if rule.max_flip_rate is not None and paired is not None:
                upper = bounds.paired_drop_upper(paired.lost, paired.gained, n, rule.confidence)
                words = (f"quality {label}: {hits}/{n} vs reference {hits_r}/{n} "
                         f"({paired.lost} lost, {paired.gained} gained, paired); "
                         f"{rule.confidence:g}-confidence upper bound of the drop {upper:.4g}")
                j.check(part, upper <= max_drop, f"{words} <= {max_drop:g}{fp32}", f"{words} > allowed {max_drop:g}{fp32}")
            else:
                more = f"{lost} case(s) fewer" if lost >= 0 else f"{-lost} case(s) more"
                words = f"quality {label}: {hits}/{n} vs reference {hits_r}/{n}, {more}"
                j.check(part, lost <= allowed + 1e-9 * max(1.0, allowed),
                        f"{words} <= allowed {max_drop:g} x {n} = {allowed:g}{fp32}",
                        f"{words} > allowed {max_drop:g} x {n} = {allowed:g}{fp32}")
        else:
            drop = ref_q - q if higher else q - ref_q
            j.check(part, drop <= max_drop,
                    f"quality {label}: {q:.4g} vs reference {ref_q:.4g} (drop {drop:.4g} <= {max_drop:g}){fp32}",
                    f"quality {label}: {q:.4g} vs reference {ref_q:.4g}, drop {drop:.4g} > allowed {max_drop:g}{fp32}")
            _column_quality(quality, max_drop, j, part, side, label)
    if rule.min_quality is not None and higher:
        j.check(part, q >= rule.min_quality, f"quality {label}: {q:.4f} >= minimum {rule.min_quality}",
                f"quality {label}: {q:.4f} below minimum {rule.min_quality}")
    elif rule.min_quality is not None:  # a smaller-is-better metric: the bound is its worst acceptable value
        j.check(part, q <= rule.min_quality, f"quality {label}: {q:.4f} <= worst acceptable {rule.min_quality}",
                f"quality {label}: {q:.4f} worse than the worst acceptable {rule.min_quality}")


def _column_quality(quality: Quality, max_drop: float, j: _Judge, part: Part, side: str, label: str) -> None:
    """Each column of a regression output of a few columns against the reference's same column: the drop the rule allows
    the whole output, as a share of the reference's error, applied to each column's own error. One RMSE pooled over
    columns of different scales is the large column's: a small column destroyed would not move it (the guide: « des
    sorties d'échelles différentes peuvent nécessiter des critères distincts »)."""
    columns = quality.columns
    if not columns or side not in columns or quality.reference == 0:  # a perfect reference: the pooled drop bounds all
        return
    share = max_drop / abs(quality.reference)
    higher = quality.higher_is_better
    failing = []
    for c, (r, q) in enumerate(zip(columns["reference"], columns[side])):
        drop = r - q if higher else q - r
        allowed = share * abs(r)
        if not math.isfinite(q) or drop > allowed + 1e-12 * abs(r):
            failing.append(f"column {c}: {q:.4g} vs reference {r:.4g}, drop {drop:.4g} > allowed {allowed:.4g}")
    share_words = f"{max_drop:g} of the reference's {abs(quality.reference):.4g}, {share:.3g} of each column's own error"
    j.check(part, not failing,
            f"quality {label}, per column: each of {len(columns['reference'])} columns within its share ({share_words})",
            f"quality {label}, per column ({share_words}): {'; '.join(failing[:3])}"
            + (f"; and {len(failing) - 3} more column(s)" if len(failing) > 3 else ""))


def _training(stats: Stats, rule: AcceptanceConfig, j: _Judge) -> None:
    train = stats.training
    trained_bad = stats.nonfinite.trained
    kinds = ", ".join(f"{v} {k}" for k, v in trained_bad.per_kind.items())
    j.check("training", trained_bad.rows == 0, "outputs of the AMP-trained model: all finite",
            f"outputs of the AMP-trained model: {trained_bad.rows} case(s) with a non-finite output ({kinds}): "
            f"{_ids(trained_bad.ids)}",
            ("nonfinite_trained", trained_bad.ids))
    _quality(stats.quality, rule, j, "training", "trained")
    ref_bad = train.first_nonfinite_reference_step
    j.check("training", ref_bad < 0, "training: every reference loss finite",
            f"training: the FP32 reference's loss is not finite from step {ref_bad}; "
            f"an incorrect FP32 run is no baseline: re-freeze",
            ("steps", [ref_bad]))
    excused = train.excused_steps
    if len(excused) == 1:  # said, never silent; the skip limits below judge how often
        j.checks.append(f"training: loss not finite at step {excused[0]}, its update skipped by the GradScaler: an incident, "
                        f"judged by the skip limits, the stall check and quality")
    elif excused:  # the guide: « un incident ponctuel ne suffit pas... » but « une baisse répétée de l'échelle n'établit pas
        # que le problème est résolu »: the loss overflows in the forward pass, before the GradScaler scales anything
        j.check("training", False, "",
                f"training: loss not finite at {len(excused)} steps ({', '.join(map(str, excused[:20]))}), each update skipped "
                f"by the GradScaler: a forward overflow that repeats, which no loss scale can fix (it scales the loss after "
                f"the forward pass); one such step is an incident, a repeated one is not", ("steps", list(excused)))
    if len(excused) <= 1 or train.first_nonfinite_loss_step >= 0:  # repeated: the reason above says it
        j.check("training", train.first_nonfinite_loss_step < 0,
                f"training: every loss finite{f' but step {excused[0]}' if excused else ''}",
                f"training: loss not finite from step {train.first_nonfinite_loss_step}",
                ("steps", [train.first_nonfinite_loss_step]))
    bad_grads = train.nonfinite_grad_steps
    j.check("training", not bad_grads, "training: every gradient norm finite (or skipped by the GradScaler)",
            f"training: non-finite gradient norm at step(s) {', '.join(map(str, bad_grads[:20]))} "
            f"with no GradScaler to skip it (the update was not applied)", ("steps", bad_grads))
    against = "FP32 aligned on the trial's skipped updates" if train.aligned_on_skips else "the FP32 reference"
    if not rule.has_loss_band:  # said, never silent
        j.checks.append("training: no fixed per-step loss band (loss_atol and loss_rtol null): the loss curve is judged "
                        "against FP32's own run-to-run spread")
    else:
        _loss_band(train, rule, j, against)
    _noise_floor(train.noise, rule, j)
    _final_loss(train.final, train.noise, rule, j)
    calibration = train.calibration_steps
    if calibration:  # said, never silent: the skips by which the GradScaler found its scale
        j.checks.append(f"training: the first {calibration} update(s) skipped while the GradScaler calibrated its scale "
                        f"(before the first real update, every loss finite): not counted in the skip limits")
    after = f" after the {calibration} of its calibration" if calibration else ""
    counted, of = train.skipped_steps - calibration, train.steps - calibration
    j.check("training", train.skipped_fraction <= rule.max_skipped_fraction,
            f"training: {counted} skipped update(s) of {of}{after} (allowed fraction {rule.max_skipped_fraction})",
            f"training: {counted} of {of} updates skipped{after}, fraction "
            f"{train.skipped_fraction:.3g} > allowed {rule.max_skipped_fraction}")
    window = train.stall_window
    # One skip at any time is the GradScaler's design (it grows the scale, then backs off once); more than the rule's
    # fraction of the last window is a scale still falling when training ends, which the whole run's fraction dilutes.
    recent = max(1, math.floor(rule.max_skipped_fraction * window + 1e-9)) if rule.max_skipped_fraction > 0 else 0
    j.check("training", train.recent_skipped_steps <= recent,
            f"training: {train.recent_skipped_steps} skipped update(s) in the last {window} steps (allowed {recent})",
            f"training: {train.recent_skipped_steps} of the last {window} updates skipped > allowed {recent} "
            f"(max_skipped_fraction {rule.max_skipped_fraction} of the window, at least one): the loss scale is still "
            f"falling when training ends (final scale {train.final_scale:g})")
    j.check("training", not train.stalled, f"training: real updates still advancing in the last {window} steps",
            f"training: updates stopped advancing: no real update in the last {window} steps")
    if train.scaler_enabled:  # without a GradScaler (bfloat16) there is no scale to fall
        j.check("training", train.final_scale >= rule.min_scale,
                f"training: final loss scale {train.final_scale:g} >= {rule.min_scale:g}",
                f"training: final loss scale {train.final_scale:g} < min_scale {rule.min_scale:g}: float16 does not hold this "
                f"model's gradients at their own size (the GradScaler shrinks them, and their small parts fall below float16's "
                f"range); the skip and stall checks say whether updates advanced")


def _loss_band(train: Training, rule: AcceptanceConfig, j: _Judge, against: str) -> None:
    """The fixed per-step loss band the rule states (calibrated at freeze: FP32's replicate stays inside it)."""
    j.check("training", train.band_violations == 0,
            f"training: loss within band of {against} at every step "
            f"(max gap {train.max_loss_gap:.4g} at step {train.max_loss_gap_step})",
            f"training: loss outside band of {against} (atol={rule.loss_atol}, rtol={rule.loss_rtol}) "
            f"at {train.band_violations} of {train.steps} steps, first at step {train.first_violation_step}",
            ("steps", [train.first_violation_step]))


def training_confidence(rule: AcceptanceConfig) -> float:
    """The confidence of each of the two prediction bounds training is read by (the final loss, the quality after
    training): together they may roll FP32 back against itself at most 1 - ``rule.confidence`` of the time, so each takes
    half of it (Bonferroni: 0.975 each at 0.95)."""
    return 1.0 - (1.0 - rule.confidence) / 2.0


def _final_loss(final: FinalLoss | None, noise: Noise | None, rule: AcceptanceConfig, j: _Judge) -> None:
    """Where training ended against where FP32 itself ends when trained again: the trial's final loss at most the larger
    of the one-sided prediction bound of another FP32 run from the reference and its replicates, at
    ``training_confidence`` (``bounds.fp32_drop_allowed``: an FP32 retraining fails it at half of 1 - confidence), and
    ``loss_noise_multiple`` (widened where FP32 needs more: ``trajectory.fp32_multiple``) times the
    replicates' mean per-step gap to the reference (the noise floor's own yardstick, read at the end: before two runs
    decorrelate, FP32's ends nearly agree, since they read the same last batches, while a change of rounding moves the
    loss about as a swapped sample does at any step), plus ``loss_noise_atol``. Judged with the noise floor
    (``loss_noise_multiple`` / ``loss_noise_atol``): both read the loss against FP32's own spread, the curve's gap and
    the end it reached (a training that stalls keeps a gap a few times FP32's, and ends far above it)."""
    if final is None or (rule.loss_noise_multiple is None and rule.loss_noise_atol is None):
        return
    ref, reps = final.fp32[0], list(final.fp32[1:])
    multiple = (noise.multiple if noise is not None else None) or rule.loss_noise_multiple or 0.0  # widened where FP32 needs
    own = (noise.mean_replicate_gap if noise is not None else 0.0) * multiple
    bound = bounds.fp32_drop_allowed(ref, reps, training_confidence(rule), higher_is_better=False)
    rise = max(bound, own) + (rule.loss_noise_atol or 0.0)
    words = (f"training: final loss {final.amp:.4g} (mean of the last {final.window} steps) vs FP32's {ref:.4g}, its "
             f"replicates {', '.join(f'{v:.4g}' for v in reps)}: an FP32 retraining may end {rise:.3g} above the reference "
             f"(the larger of its prediction bound at confidence {training_confidence(rule):g} and {multiple:.3g}x the "
             f"replicates' mean gap)")
    j.check("training", final.amp - ref <= rise, f"{words}; within it",
            f"{words}; this one ends {final.amp - ref:.3g} above: training did not reach where FP32 does")


def _distribution(dist: Distribution | None, rule: AcceptanceConfig, j: _Judge, flips: Decisions) -> None:
    """KL and top-1 agreement of per-token outputs, each applied when the rule sets it, on its conservative side.

    The fixed set's tokens are a sample: ``max_kl_mean`` holds the one-sided upper bound of the mean at
    ``rule.confidence`` (mean + z SE, z = 1.645 at 0.95: the same confidence as the flip rate's bound) plus the
    store's bound; ``max_kl_p99`` the p99's upper edge plus the store's bound; ``min_top1_agreement`` the
    Clopper-Pearson lower bound of the agreement at ``rule.confidence`` (exact for a rate near 1, where
    mean - z SE is not), over the flip rate's sample (``flips.sample``: the ordinary cases' tokens, the tokens of a
    selected copy or an edge case changing it as flips do). With full stores and many tokens these move by the SE
    alone."""
    wanted = [rule.max_kl_mean, rule.max_kl_p99, rule.min_top1_agreement]
    if all(w is None for w in wanted):
        return
    if dist is None:
        j.check("inference", False, "",
                "distribution: the rule sets max_kl_mean / max_kl_p99 / min_top1_agreement but the outputs are "
                "not per-token scores [N, T, C]; remove those criteria or compare per-token outputs")
        return
    if not dist.tokens:
        j.check("inference", False, "",
                "distribution: no valid token to measure KL or top-1 agreement on (every target is -100 or "
                "masked); give eval targets, or remove max_kl_mean / max_kl_p99 / min_top1_agreement")
        return
    exact = "" if dist.kl_p99_exact else " (upper edge of a streamed estimate)"
    z = statistics.NormalDist().inv_cdf(rule.confidence)
    store = f" + store bound {dist.kl_mean_bound:.2g}" if dist.kl_mean_bound else ""
    mean_more = f" (mean {dist.kl_mean:.4g} + {z:.3g} SE {dist.kl_mean_se:.2g}{store}: {rule.confidence:g}-confidence upper)"
    p99_more = exact + (f" + store bound {dist.kl_p99_bound:.2g}" if dist.kl_p99_bound else "")
    for value, limit, label, more in (
        (dist.kl_mean + z * dist.kl_mean_se + dist.kl_mean_bound, rule.max_kl_mean, "mean", mean_more),
        (dist.kl_p99_upper + dist.kl_p99_bound, rule.max_kl_p99, "p99", p99_more),
    ):
        if limit is not None:
            j.check(
                "inference", value <= limit,
                f"distribution: KL(reference || trial) {label} {value:.4g} nats{more} over {dist.tokens} tokens <= {limit:g}",
                f"distribution: KL(reference || trial) {label} {value:.4g} nats{more} > allowed {limit:g} "
                f"(max {dist.kl_max:.4g})",
            )
    if rule.min_top1_agreement is not None:
        value = 1.0 - bounds.binomial_upper(flips.sample_flips, flips.sample, rule.confidence)
        words = (f"top-1 agreement {dist.top1_agreement:.6f} +- {dist.top1_agreement_se:.2g} "
                 f"({rule.confidence:g}-confidence lower bound {value:.6f} over {flips.sample} ordinary tokens)")
        j.check("inference", value >= rule.min_top1_agreement,
                f"distribution: {words} >= {rule.min_top1_agreement:g}",
                f"distribution: {words} below minimum {rule.min_top1_agreement:g}")


def _noise_floor(noise: Noise | None, rule: AcceptanceConfig, j: _Judge) -> None:
    """AMP's per-step loss gap bounded by a multiple of FP32's own noise (the replicate's gap), when set."""
    if rule.loss_noise_multiple is None and rule.loss_noise_atol is None:
        return
    if noise is None:
        j.check("training", False, "",
                "training: the rule bounds the loss gap by the noise floor (loss_noise_multiple / loss_noise_atol) "
                "but the reference has no replicate trajectory; set reference.replicates: 2 and re-freeze")
        return
    band = f"{noise.multiple or 0:.3g} x FP32's own run-to-run gap + {rule.loss_noise_atol or 0:g}"
    if noise.stated_multiple is not None:
        band += f"; the rule's {noise.stated_multiple:g}x, widened: FP32's replicates differ by that much among themselves"
    figures = (f"mean gap {noise.mean_amp_gap:.3g} vs FP32 replicate {noise.mean_replicate_gap:.3g}, largest "
               f"{noise.max_amp_gap:.3g} vs {noise.max_replicate_gap:.3g}")
    j.check(
        "training", noise.violations == 0,
        f"training: loss curve within the noise floor ({band}): {figures}",
        f"training: loss curve above the noise floor ({band}) on its "
        f"{' and '.join(noise.over if noise.over is not None else ('gap',))}: {figures}; "
        f"largest at step {noise.first_violation_step}",
        ("steps", [noise.first_violation_step]),
    )


def vet_rule(
    rule: AcceptanceConfig, kind: str, shapes: dict[str, tuple], rms: dict[str, float], ref_quality: float, metric: str,
    higher_is_better: bool, ref_steps: Sequence[StepRecord], columns: dict[str, Sequence[float]] | None = None,
    distributions: Sequence[str] = (), real_units: int | None = None, tokens: int | None = None,
    spreads: dict[str, Sequence[tuple[float, float]]] | None = None, whole_numbers: dict[str, float] | None = None,
    masked: dict[str, float] | None = None, channels_first: dict[str, tuple[int, str]] | None = None,
    unit_heads: Sequence[str] = (), misnamed: Sequence[str] = (), probability_rows: Sequence[str] = (),
    top_k: int | None = None, replicate: Sequence[StepRecord] | None = None, with_target: bool = False,
    logit_like: str | None = None, per_label: Sequence[str] = (), spread: FP32Spread | None = None,
    more_replicates: Sequence[Sequence[StepRecord]] = (),
) -> str | None:
    """The first reason the rule cannot judge trials of this FP32 reference, as one line, or None.

    Run at freeze, before any trial: a rule whose criteria cannot fail (a tolerance as large as the output it
    bounds, a quality drop as large as the reference's own error, a loss band wider than the loss) would
    accept noise; a name the model does not output would silently fall under ``*``; a reference that is
    itself non-finite or below the rule's quality is no baseline (the guide: « Sorties finies et qualité
    attendue »). ``columns``: the RMS of each column of a regression's outputs [N, D], when known: one atol
    must be below the smallest (« des sorties d'échelles différentes peuvent nécessiter des critères distincts »).
    ``distributions``: a regression's other outputs whose every reference row is a probability distribution while
    neither their name nor their entry says whether they are decisions: class probabilities would go undecided
    (« Une différence faible en valeur absolue peut changer l'action choisie »), proportions would not be; the user says.
    ``real_units``: the ordinary cases (per token: their kept positions) of the primary's decisions, which
    ``max_flip_rate``'s bound needs enough of to pass at all. ``spreads``: per output judged by its values alone, per
    column, (mean, standard deviation) in the reference: the band atol + rtol·|mean| must be below the spread, or a
    trial answering one value for every case would pass (an offset, 101325 Pa ± 59, makes rtol's band the offset's).
    ``whole_numbers``: per output whose every reference value is a whole number (beyond 0 and 1), its largest magnitude:
    a class index, a bin or a count, whose unit is 1; a band that reaches 1 there passes a changed class.
    ``masked``: a regression's other outputs shaped like class scores, undecided as ``distributions`` are, whose reference
    holds masking values (their lowest: ``vetting.masking_value``): judged by values, a float16 trial's -65504 against
    FP32's -3.4e38 always fails; decided, pairs masked on both sides agree. ``channels_first``: per decided output
    [N, a, L] whose last axis, where its argmax is taken, is the task's positions (L, and where it is known from) and its
    axis 1 is not: a class flip there would go uncounted. ``unit_heads``: decided single-value heads whose name says
    neither probability nor logit and whose reference lies in [0, 1]: read as probabilities (decided at 0.5), though a
    logit is decided at 0 (« Une différence faible en valeur absolue peut changer l'action choisie »). ``misnamed``:
    decided single-value heads named like a probability whose reference leaves [0, 1] (a ``log_prob``): decided at 0.5,
    none of their decisions could flip. ``probability_rows``: decided outputs whose every reference row is a probability
    distribution: KL (per token) and probability margins take class scores through softmax, which measures nothing on
    probabilities. ``top_k``: the k of metric ``top_k``: with as many classes or fewer, every target is a hit.
    ``replicate``: the FP32 replicate's steps, the noise floor of ``loss_noise_multiple``. ``with_target``: some case
    with a target was scored (a non-finite ``ref_quality`` is then the metric's own). ``logit_like``: the primary that
    ``loss: model`` with one value reads as a value fitted to labels 0 or 1 (Hugging Face's regression head, MSE: decided
    at 0.5), whose reference spreads as a sigmoid's logits do (a model's own BCE: decided at 0). ``per_label``: outputs
    read as class scores (argmax) that have the shape of a primary whose labels are each decided at a threshold.
    ``spread``: the FP32 replicate's quality after training beside the reference's: a minimum FP32 itself misses after
    training cannot tell precision from noise (the A/A of ``min_quality``). ``more_replicates``: the replicates after the
    first, checked as it is."""
    names = sorted(shapes)
    unknown = sorted(n for n in rule.outputs if n != "*" and n not in shapes and rule.outputs[n].role != "ignored")
    if unknown:
        return (f"params.yaml: acceptance.outputs names {', '.join(map(repr, unknown))}, which the model does not output; "
                f"its outputs are {', '.join(map(repr, names))}: fix the name")
    for name in names:
        if name not in rule.outputs and "*" not in rule.outputs:
            return (f"params.yaml: acceptance.outputs has no entry for output '{name}' and no '*'; "
                    f"add '{name}': {{atol: ..., rtol: ...}} in the output's own units")
        key = name if name in rule.outputs else "*"
        atol, scale = rule.outputs[key].atol, rms.get(name, 0.0)
        if scale > 0 and atol >= scale:
            return (f"params.yaml: acceptance.outputs.{key}.atol {atol:g} is not below the scale of output '{name}' "
                    f"(RMS {scale:.3g} in the FP32 reference), so a trial off by the output's whole size would pass; "
                    f"give '{name}': {{atol: ..., rtol: ...}} in its own units, "
                    f"for example atol {0.01 * scale:.2g} (1% of its RMS)")
        per_column = list((columns or {}).get(name, ()))
        scaled = [j for j, v in enumerate(per_column) if v > 0]  # a column of zeros has no scale to be below
        small = min(scaled, key=per_column.__getitem__) if scaled else None
        if small is not None and per_column[small] <= atol:
            return (f"params.yaml: acceptance.outputs.{key}.atol {atol:g} is not below the scale of column {small} of "
                    f"output '{name}' (RMS {per_column[small]:.3g} in the FP32 reference; its largest column "
                    f"{max(per_column):.3g}), so a trial off by that column's whole size would pass; give '{name}' an atol "
                    f"below it, for example {0.01 * per_column[small]:.2g}, and let rtol bound the larger columns, or return "
                    f"the column as an output of its own")
    if distributions:
        name = distributions[0]
        return (f"params.yaml: output '{name}' of the regression holds, in every row of the FP32 reference, non-negative "
                f"values summing to 1, like class probabilities, but neither its name nor acceptance.outputs says whether "
                f"they are decisions; give '{name}': {{decisions: true}} under acceptance.outputs to judge the class each row "
                f"picks too, or {{decisions: false}} to judge its values only (proportions)")
    if masked:
        name = min(masked)
        return (f"params.yaml: output '{name}' of the regression holds masked scores like logits ({masked[name]:.3g} in its "
                f"FP32 reference: classes ruled out with masked_fill), but neither its name nor acceptance.outputs says "
                f"whether they are decisions; give '{name}': {{decisions: true}} under acceptance.outputs to judge the class "
                f"each row picks and let pairs masked on both sides agree, or {{decisions: false}} to judge its values only, "
                f"which a float16 trial's -65504 against FP32's -3.4e38 never passes")
    if per_label:
        name, main = per_label[0], primary_name(shapes)
        return (f"params.yaml: output '{name}' has the shape of '{main}', whose labels are each decided at a threshold "
                f"(multi-label), but it would be judged as class scores, by argmax across labels that are decided one by "
                f"one, and roll back for swaps between two labels that both stay on; give '{name}': {{decisions: false}} "
                f"under acceptance.outputs to judge its values (the labels are decided on '{main}'), or return one of them")
    if logit_like:
        return (f"params.yaml: output '{logit_like}' is one value per case with labels 0 or 1 under loss: model, read as "
                f"Hugging Face's regression head (MSE: values fitted to the labels, decided at 0.5), but many of its FP32 "
                f"reference values lie outside [-0.5, 1.5], or far more of its labels are right read at 0 than at 0.5, as a "
                f"sigmoid's logits are (decided at 0); say where it is "
                f"decided: acceptance.threshold: 0 for logits, 0.5 for fitted values")
    if misnamed:
        name = misnamed[0]
        return (f"params.yaml: output '{name}' holds one decision per case (or token) as a single value, named like a "
                f"probability, so compare decides it at 0.5, but the FP32 reference holds values outside [0, 1] (a "
                f"log-probability, a logit), so no decision of it could ever flip; return the probability or the logit "
                f"under a name that says which ('..._prob', '..._logit'), or give '{name}': {{decisions: false}} under "
                f"acceptance.outputs to judge its values only")
    softmaxed = [name for name in probability_rows
                 if rule.boundary_margin_kind == "probability"
                 or (len(shapes.get(name, ())) == 2 and (rule.max_kl_mean is not None or rule.max_kl_p99 is not None))]
    if softmaxed:
        name = softmaxed[0]
        return (f"params.yaml: output '{name}' holds probabilities (every row of the FP32 reference sums to 1), but the "
                f"rule reads class scores through softmax (max_kl_mean / max_kl_p99 per token, boundary_margin_kind "
                f"probability), which on probabilities measures almost nothing; return the logits, or the log-probabilities "
                f"(softmax of log p is p), or judge '{name}' without those criteria")
    if unit_heads:
        name = unit_heads[0]
        return (f"params.yaml: output '{name}' holds one decision per case (or token) as a single value, every one of "
                f"them in [0, 1] in the FP32 reference, so compare would read it as a probability decided at 0.5, where a "
                f"logit is decided at 0, but its name says neither; name the output so that it says which ('{name}_prob' "
                f"for a sigmoid's probability, '{name}_logit' for a logit), or give '{name}': {{decisions: false}} under "
                f"acceptance.outputs to judge its values only")
    for name in names:  # after the questions above, which name both of their fixes
        key = name if name in rule.outputs else "*"
        atol = rule.outputs[key].atol
        top = (whole_numbers or {}).get(name)
        if top is not None and atol + rule.outputs[key].rtol * top >= 1.0:
            return (f"params.yaml: acceptance.outputs.{key}: atol {atol:g} + rtol {rule.outputs[key].rtol:g} x {top:g} "
                    f"reaches 1 on output '{name}', whose every value in the FP32 reference is a whole number (a class, "
                    f"a bin, a count: its unit is 1), so a trial one unit off would pass; give '{name}' "
                    f"{{atol: 0.5, rtol: 0}} (any change fails), or return scores instead of the index")
        for c, (mean, std) in enumerate((spreads or {}).get(name, ())):
            band = atol + rule.outputs[key].rtol * abs(mean)
            if std > 0 and band >= std:
                where = f"column {c} of output '{name}'" if len(spreads[name]) > 1 else f"output '{name}'"
                return (f"params.yaml: acceptance.outputs.{key}: atol {atol:g} + rtol {rule.outputs[key].rtol:g} x |mean| "
                        f"= {band:.3g} is not below the spread of {where} (mean {mean:.6g}, standard deviation {std:.3g} "
                        f"in the FP32 reference), so a trial answering one value for every case would pass; give '{name}' "
                        f"a tolerance below its spread, for example {{atol: {0.01 * std:.2g}, rtol: 0}}")
    scored = [n for n in names if len(shapes[n]) >= 3 and (n != primary_name(names) or kind == "classification")
              and heads.scored(rule.tolerance(n), n, kind)]
    if scored:  # [N, a, b, c...]: no decision check reads it (class scores are [N, C] or [N, T, C])
        name = scored[0]
        return (f"params.yaml: output '{name}' of shape [N, {', '.join(map(str, shapes[name]))}] is named like scores (or "
                f"says decisions: true), but no decision check reads an output of {len(shapes[name]) + 1} dims, so its "
                f"decisions would go untested; return it as [N, T, classes] (classes last), or give it "
                f"'{name}': {{decisions: false}} under acceptance.outputs to judge its values only")
    if channels_first:
        name = min(channels_first)
        length, where = channels_first[name]
        return (f"params.yaml: output '{name}' of shape [N, {', '.join(map(str, shapes[name]))}] is decided by the argmax "
                f"of its last axis, but that axis is the task's {length} positions ({where}) and its axis 1 is not, like a "
                f"Conv1d's scores [N, classes, L], so its class flips would go uncounted; return it as [N, T, classes] "
                f"(.transpose(1, 2)), each pointer over positions (start, end logits) as an [N, T] output of its own, or "
                f"give '{name}': {{decisions: false}} under acceptance.outputs to judge its values only")
    main = primary_name(names)
    distribution = [key for key in ("max_kl_mean", "max_kl_p99", "min_top1_agreement") if getattr(rule, key) is not None]
    if distribution and not (kind == "classification" and len(shapes[main]) == 2):
        return (f"params.yaml: acceptance.{distribution[0]} judges per-token scores [N, T, classes], but the "
                f"{'classifier' if kind == 'classification' else 'regression'}'s output '{main}' is "
                f"[N, {', '.join(map(str, shapes[main]))}], so every trial would roll back; set "
                f"{', '.join(distribution)} to null (flips, values and quality judge it)")
    needed = bounds.cases_needed(rule.max_flip_rate, rule.confidence) if rule.max_flip_rate is not None else 0
    if needed == math.inf:
        return (f"params.yaml: acceptance.max_flip_rate {rule.max_flip_rate:g}: its upper bound is above 0 on any set, even "
                f"with no flip, so every trial would roll back; for no flip at all use max_flip_rate: null and max_flips: 0")
    if real_units is not None and real_units < needed:  # every decided output is judged against it on its own
        per_case = [n for n, shape in shapes.items()
                    if n != main and len(shape) <= 1 and heads.decides(rule.tolerance(n), n, kind)]
        unit = "position" if kind == "classification" and len(shapes[main]) == 2 and not per_case else "case"
        least = 1.0 - (1.0 - rule.confidence) ** (1.0 / real_units) if real_units else 1.0
        return (f"params.yaml: acceptance.max_flip_rate {rule.max_flip_rate:g} at confidence {rule.confidence:g} needs at "
                f"least {needed} ordinary {unit}s to pass even with no flip (the Clopper–Pearson bound; edge and selected "
                f"cases are no independent draws), and the fixed set has {real_units}, so every trial would roll back; give "
                f"more cases (prepare), a max_flip_rate of at least {least:.3g}, or max_flip_rate: null to count flips "
                f"(max_flips)")
    if rule.min_top1_agreement is not None and tokens is not None and rule.min_top1_agreement > 0:
        reach = 1.0 - bounds.binomial_upper(0, tokens, rule.confidence)
        if reach < rule.min_top1_agreement:
            return (f"params.yaml: acceptance.min_top1_agreement {rule.min_top1_agreement:g} at confidence "
                    f"{rule.confidence:g}: over the fixed set's {tokens} ordinary tokens the Clopper–Pearson lower bound is "
                    f"at most {reach:.6f} even when every token agrees, so every trial would roll back; give more cases "
                    f"(prepare), a min_top1_agreement of at most {reach:.4g}, or null")
    if kind == "classification" and rule.boundary_margin_kind == "relative":
        few = [n for n in names if math.prod(shapes[n][-1:]) < 3 and heads.decides(rule.tolerance(n), n)]  # entries checked above
        if few:
            return (f"params.yaml: acceptance.boundary_margin_kind relative divides the top-2 margin by the spread of the "
                    f"row's scores, which for output '{few[0]}' of {math.prod(shapes[few[0]][-1:])} class score(s) is the "
                    f"margin itself (times sqrt 2): no case would ever be near the boundary; use logit or probability")
    for step in ref_steps:
        if not math.isfinite(step.loss) or not math.isfinite(step.grad_norm):
            what = "loss" if not math.isfinite(step.loss) else "gradient norm"
            return (f"the FP32 reference's {what} is not finite at step {step.step}: an incorrect FP32 run is no baseline; "
                    f"fix the model, the data or the recipe (reference.lr, reference.grad_clip), then rerun")
    classes = shapes[main][-1] if kind == "classification" and shapes.get(main) else None
    if metric == "top_k" and top_k is not None and classes is not None and top_k >= classes and rule.judges_quality:
        return (f"params.yaml: task.top_k {top_k} is not below the {classes} classes output '{main}' scores, so every target "
                f"is among the top {top_k} and the quality criteria (min_quality, max_quality_drop) cannot fail; give "
                f"task.top_k below {classes}, or metric: accuracy")
    for each in [replicate, *more_replicates] if replicate is not None else []:
        noise = _replicate_problem(rule, ref_steps, each)
        if noise:
            return noise
    span = metric_range(metric)
    if rule.min_quality is not None and not span[0] <= rule.min_quality <= span[1]:  # ``auto`` read as label_accuracy
        return (f"params.yaml: acceptance.min_quality {rule.min_quality:g} is outside [{span[0]:g}, {span[1]:g}], the range "
                f"of the quality metric in effect, {metric}; give one in that range, or name task.metric")
    if not math.isfinite(ref_quality) and rule.judges_quality and with_target:
        return (f"the FP32 reference's quality ({metric}) is {ref_quality} over the cases with a target, so the rule's "
                f"quality criteria cannot judge any trial; fix task.metric (R2 of a constant target, for one, is undefined), "
                f"or set acceptance.max_quality_drop: null and min_quality: null to judge without quality")
    if not math.isfinite(ref_quality) and rule.judges_quality:
        return f"the FP32 reference has no quality to judge trials by: {NO_TARGET}"
    if math.isfinite(ref_quality):
        if rule.min_quality is not None and (
            ref_quality < rule.min_quality if higher_is_better else ref_quality > rule.min_quality
        ):
            return (f"the FP32 reference's quality ({metric} {ref_quality:.4g}) does not meet acceptance.min_quality "
                    f"{rule.min_quality:g}, so every trial would roll back: fix the reference (training, data) before any trial, "
                    f"or set the minimum it can meet")
        missed = [q for q in (spread.replicates if spread else ()) if rule.min_quality is not None
                  and not (q >= rule.min_quality if higher_is_better else q <= rule.min_quality)]
        if missed:
            runs = (*spread.replicates, ref_quality)
            worst = min(runs) if higher_is_better else max(runs)
            return (f"acceptance.min_quality {rule.min_quality:g}: FP32's own replicate (trained again on another data "
                    f"order) reaches {metric} {missed[0]:.4g} after training, against the reference's {ref_quality:.4g}, so "
                    f"the minimum cannot tell precision from FP32's own run-to-run spread; set a minimum FP32 meets with "
                    f"room (beyond {worst:.4g}), "
                    f"or min_quality: null and let max_quality_drop judge against FP32's spread")
        if (
            metric in ("neg_rmse", "neg_mae") and rule.max_quality_drop is not None
            and 0 < abs(ref_quality) <= rule.max_quality_drop
        ):
            return (f"params.yaml: acceptance.max_quality_drop {rule.max_quality_drop:g} is not below the reference's own error "
                    f"({metric[4:].upper()} {abs(ref_quality):.3g}), so a trial twice as wrong would pass; "
                    f"give it in the target's units, for example {0.1 * abs(ref_quality):.2g}")
    return _loss_band_problem(rule, ref_steps, replicate, more_replicates)


def _loss_band_problem(rule: AcceptanceConfig, ref_steps: Sequence[StepRecord], replicate: Sequence[StepRecord] | None,
                       more_replicates: Sequence[Sequence[StepRecord]] = ()) -> str | None:
    """Why a stated per-step loss band (``loss_atol``, ``loss_rtol``) cannot tell precision from noise, or None: FP32's
    own replicate leaves it (its A/A calibration), or it is as wide as the loss, so that it cannot fail."""
    if not rule.has_loss_band:
        return None
    atol, rtol = rule.loss_atol or 0.0, rule.loss_rtol or 0.0
    stated = f"acceptance.loss_atol {rule.loss_atol} / loss_rtol {rule.loss_rtol}"
    losses = [abs(s.loss) for s in ref_steps]
    mean_loss = sum(losses) / len(losses) if losses else 0.0
    if mean_loss > 0 and atol >= mean_loss:
        return (f"params.yaml: acceptance.loss_atol {atol:g} is not below the reference's mean training loss "
                f"({mean_loss:.3g}), so the training band cannot fail; give it in the loss's units, "
                f"for example {0.05 * mean_loss:.2g}, or set loss_atol: null and loss_rtol: null to judge the curve "
                f"against FP32's own spread")
    if replicate is None:
        return (f"params.yaml: {stated} states a fixed per-step loss band, which freeze calibrates on FP32's own "
                f"replicate; set reference.replicates: 2, or loss_atol: null and loss_rtol: null")
    # The band's excess per step, each replicate against the reference: above 0, FP32 itself is outside it there.
    excess = [max(abs(b.loss - a.loss) - (atol + rtol * abs(a.loss)) for b in bs)
              for a, *bs in zip(ref_steps, replicate, *more_replicates)]
    outside = [i for i, e in enumerate(excess) if not e <= 0]
    if not outside:
        return None
    needed = max(e + atol for e in excess)
    return (f"params.yaml: {stated}: FP32's own replicate (another data order) leaves this per-step band at "
            f"{len(outside)} of {len(excess)} steps (first at step {ref_steps[outside[0]].step}), so it cannot tell "
            f"precision from noise; FP32 passes it with loss_atol >= {needed:.3g} at loss_rtol {rtol:g}, or set "
            f"loss_atol: null and loss_rtol: null to judge the curve against FP32's own spread (loss_noise_multiple)")


def _replicate_problem(rule: AcceptanceConfig, ref_steps: Sequence[StepRecord],
                       replicate: Sequence[StepRecord] | None) -> str | None:
    """Why the FP32 replicate gives the noise floor (``loss_noise_multiple``, ``loss_noise_atol``) nothing to judge by,
    or None: a non-finite loss (an infinite gap there: any multiple of it passes every trial) or, without an atol, a run
    identical to the reference (a gap of 0: any multiple of it rolls back every trial that differs at all; one update
    has no pair of updates to swap samples between)."""
    if replicate is None or (rule.loss_noise_multiple is None and rule.loss_noise_atol is None):
        return None
    for step in replicate:
        if not math.isfinite(step.loss):
            return (f"the FP32 replicate's loss is not finite at step {step.step}, so FP32's own run-to-run noise is "
                    f"unknown and the noise floor would judge no trial; fix the model, the data or the recipe so "
                    f"that FP32 trains on another data order too, or set acceptance.loss_noise_multiple: null, "
                    f"loss_noise_atol: null and reference.replicates: 0")
    same = len(replicate) == len(ref_steps) and all(a.loss == b.loss for a, b in zip(replicate, ref_steps))
    if same and not rule.loss_noise_atol:
        return (f"the FP32 replicate repeats the reference's losses exactly over its {len(ref_steps)} step(s) (another data "
                f"order needs two updates or more to swap samples between), so FP32's run-to-run gap is 0 and "
                f"loss_noise_multiple would roll back every trial whose loss differs at all; train more steps "
                f"(reference.train_steps), or set acceptance.loss_noise_multiple: null and reference.replicates: 0")
    return None


# Direction in which each numeric criterion of the rule gets looser: +1 when a larger value lets more
# through. For a criterion that may be null, null means "not applied", the loosest of all.
# tests/test_rule.py ties this table to AcceptanceConfig: a new field cannot be forgotten here.
_LOOSER_WHEN = {
    "max_failing_fraction": +1,
    "boundary_margin": +1,  # more real cases count as near the boundary, whose flips may be limited less
    "max_flips": +1,
    "max_near_boundary_flips": +1,
    "max_flip_rate": +1,
    "confidence": -1,
    "max_boundary_flip_fraction": +1,
    "max_kl_mean": +1,
    "max_kl_p99": +1,
    "min_top1_agreement": -1,
    "min_quality": -1,
    "max_quality_drop": +1,
    "loss_rtol": +1,
    "loss_atol": +1,
    "loss_noise_multiple": +1,
    "loss_noise_atol": +1,
    "max_skipped_fraction": +1,
    "stall_window": +1,
    "min_scale": -1,
    "min_amp_share": -1,
}
# Criteria that are not a number on a line, compared by ``loosened`` one by one.
_COMPARED_APART = ("outputs", "tie_rule", "threshold", "boundary_margin_kind")


def loosened(old: AcceptanceConfig, new: AcceptanceConfig) -> list[str]:
    """Criteria on which rule ``new`` lets through more than rule ``old``.

    Any loosened criterion is listed, even if others were tightened: a tolerance widened to make a
    case disappear must be visible whatever else changed.
    """
    out = []
    for name in sorted(set(old.outputs) | set(new.outputs)):
        o, n = _tolerance(old, name), _tolerance(new, name)
        for key in ("atol", "rtol"):
            if o is not None and n is not None and getattr(n, key) > getattr(o, key):
                out.append(f"outputs.{name}.{key} {getattr(o, key):g} -> {getattr(n, key):g}")
        if (o is None or heads.decides(o, name)) and n is not None and not heads.decides(n, name):  # false, null on features
            if n.role is not None:
                out.append(f"outputs.{name}.role {o.role if o else None} -> {n.role}")
            else:
                said = "false" if n.decisions is False else "null"
                out.append(f"outputs.{name}.decisions {o.decisions if o else None} -> {said}")
    for key, sign in _LOOSER_WHEN.items():
        a, b = getattr(old, key), getattr(new, key)
        if a is None and b is None:
            continue
        if a is not None and b is None:
            out.append(f"{key} removed (was {a:g})")
            continue
        if a is None:
            continue
        if (b - a) * sign > 0:
            out.append(f"{key} {a:g} -> {b:g}")
    if old.tie_rule == "tie_is_flip" and new.tie_rule == "lowest_index":
        out.append("tie_rule tie_is_flip -> lowest_index")
    if old.threshold is not None and new.threshold is None:
        out.append("threshold removed")
    if old.boundary_margin_kind != new.boundary_margin_kind:
        # Another unit: not comparable, so listed (a margin in logits of 0.05 may be 0.3 in probability).
        out.append(f"boundary_margin_kind {old.boundary_margin_kind} -> {new.boundary_margin_kind}")
    return out


def _tolerance(rule: AcceptanceConfig, output: str) -> Tolerance | None:
    """``rule.tolerance(output)``, None where the rule has neither the name nor ``*`` (nothing to compare)."""
    try:
        return rule.tolerance(output)
    except UserError:
        return None
