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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipeline.present import verdict

from pipeline.artifacts.comparison import (Decisions, Distribution, FinalLoss, Noise, Quality, Stats,
                                           Training)
from pipeline.compare import bounds
from pipeline import heads
from pipeline.config import AcceptanceConfig, Policy, Tolerance
from pipeline.errors import UserError

if TYPE_CHECKING:  # the loop's record: training imports torch, the rule does not
    from pipeline.artifacts.audit import Audit  # read by attribute: the stages that pass one list its file

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
    how = (f"float8 ({policy.float8})" if policy.float8 != "off" else f"autocast ({policy.dtype})" if policy.amp
           else f"FSDP2 mixed precision ({policy.fsdp_param_dtype})")
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
