"""Why the acceptance rule cannot judge trials of this FP32 reference: small named checks over one record of facts.

Run at freeze, before any trial (``vetting.Scan`` gathers the ``Facts`` as the outputs stream to disk). A rule whose
criteria cannot fail (a tolerance as large as the output it bounds, a quality drop as large as the reference's own error,
a loss band wider than the loss) would accept noise; a name the model does not output would silently fall under ``*``; a
reference that is itself non-finite or below the rule's quality is no baseline (the guide: « Sorties finies et qualité
attendue »).

Each check is a function of (rule, facts) that gives one line naming the output and the fix, or None; ``problem``
gives the first, in the order of ``CHECKS``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline import heads
from pipeline.compare import bounds
from pipeline.config import AcceptanceConfig, metric_range
from pipeline.heads import primary_name
from pipeline.rule import NO_TARGET

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import FP32Spread
    from pipeline.artifacts.steps import StepRecord


@dataclass(frozen=True)
class Facts:
    """The reference's facts the rule is vetted against: each output's shape past the rows (``shapes``) and RMS
    (``rms``), the reference's quality in the metric compare reads (``ref_quality``, ``metric``, ``higher_is_better``),
    its training steps (``ref_steps``), and what the scan found of each output.
    ``columns``: the RMS of each column of a regression's outputs [N, D], when known: one atol
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

    kind: str
    shapes: dict[str, tuple]
    rms: dict[str, float]
    ref_quality: float
    metric: str
    higher_is_better: bool
    ref_steps: Sequence[StepRecord]
    columns: dict[str, Sequence[float]] | None = None
    distributions: Sequence[str] = ()
    real_units: int | None = None
    tokens: int | None = None
    spreads: dict[str, Sequence[tuple[float, float]]] | None = None
    whole_numbers: dict[str, float] | None = None
    masked: dict[str, float] | None = None
    channels_first: dict[str, tuple[int, str]] | None = None
    unit_heads: Sequence[str] = ()
    misnamed: Sequence[str] = ()
    probability_rows: Sequence[str] = ()
    top_k: int | None = None
    replicate: Sequence[StepRecord] | None = None
    with_target: bool = False
    logit_like: str | None = None
    per_label: Sequence[str] = ()
    spread: FP32Spread | None = None
    more_replicates: Sequence[Sequence[StepRecord]] = ()

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    @property
    def main(self) -> str:
        return primary_name(self.shapes)


def problem(rule: AcceptanceConfig, facts: Facts) -> str | None:
    """The first reason the rule cannot judge trials of this FP32 reference, as one line, or None."""
    for check in CHECKS:
        line = check(rule, facts)
        if line:
            return line
    return None


def _outputs_named(rule: AcceptanceConfig, f: Facts) -> str | None:
    """Every name in acceptance.outputs is an output of the model (an ignored one too)."""
    shapes, names = f.shapes, f.names
    unknown = sorted(n for n in rule.outputs if n != "*" and n not in shapes and rule.outputs[n].role != "ignored")
    if unknown:
        return (f"params.yaml: acceptance.outputs names {', '.join(map(repr, unknown))}, which the model does not output; "
                f"its outputs are {', '.join(map(repr, names))}: fix the name")
    return None


def _tolerances_below_scale(rule: AcceptanceConfig, f: Facts) -> str | None:
    """Every output has an entry, and its atol is below the output's scale and each column's."""
    rms, columns, names = f.rms, f.columns, f.names
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
    return None


def _undecided_distributions(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A regression's other output of probability rows says whether it is decisions."""
    distributions = f.distributions
    if distributions:
        name = distributions[0]
        return (f"params.yaml: output '{name}' of the regression holds, in every row of the FP32 reference, non-negative "
                f"values summing to 1, like class probabilities, but neither its name nor acceptance.outputs says whether "
                f"they are decisions; give '{name}': {{decisions: true}} under acceptance.outputs to judge the class each row "
                f"picks too, or {{decisions: false}} to judge its values only (proportions)")
    return None


def _undecided_masked_scores(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A regression's other output of masked scores says whether it is decisions."""
    masked = f.masked
    if masked:
        name = min(masked)
        return (f"params.yaml: output '{name}' of the regression holds masked scores like logits ({masked[name]:.3g} in its "
                f"FP32 reference: classes ruled out with masked_fill), but neither its name nor acceptance.outputs says "
                f"whether they are decisions; give '{name}': {{decisions: true}} under acceptance.outputs to judge the class "
                f"each row picks and let pairs masked on both sides agree, or {{decisions: false}} to judge its values only, "
                f"which a float16 trial's -65504 against FP32's -3.4e38 never passes")
    return None


def _no_argmax_across_labels(rule: AcceptanceConfig, f: Facts) -> str | None:
    """No output is decided by argmax across labels that are decided one by one."""
    shapes, per_label = f.shapes, f.per_label
    if per_label:
        name, main = per_label[0], primary_name(shapes)
        return (f"params.yaml: output '{name}' has the shape of '{main}', whose labels are each decided at a threshold "
                f"(multi-label), but it would be judged as class scores, by argmax across labels that are decided one by "
                f"one, and roll back for swaps between two labels that both stay on; give '{name}': {{decisions: false}} "
                f"under acceptance.outputs to judge its values (the labels are decided on '{main}'), or return one of them")
    return None


def _logit_or_fitted_value(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A primary read as fitted values (0.5) does not spread as a sigmoid's logits do (0)."""
    logit_like = f.logit_like
    if logit_like:
        return (f"params.yaml: output '{logit_like}' is one value per case with labels 0 or 1 under loss: model, read as "
                f"Hugging Face's regression head (MSE: values fitted to the labels, decided at 0.5), but many of its FP32 "
                f"reference values lie outside [-0.5, 1.5], or far more of its labels are right read at 0 than at 0.5, as a "
                f"sigmoid's logits are (decided at 0); say where it is "
                f"decided: acceptance.threshold: 0 for logits, 0.5 for fitted values")
    return None


def _probabilities_in_range(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A head named like a probability holds values in [0, 1]."""
    misnamed = f.misnamed
    if misnamed:
        name = misnamed[0]
        return (f"params.yaml: output '{name}' holds one decision per case (or token) as a single value, named like a "
                f"probability, so compare decides it at 0.5, but the FP32 reference holds values outside [0, 1] (a "
                f"log-probability, a logit), so no decision of it could ever flip; return the probability or the logit "
                f"under a name that says which ('..._prob', '..._logit'), or give '{name}': {{decisions: false}} under "
                f"acceptance.outputs to judge its values only")
    return None


def _no_softmax_of_probabilities(rule: AcceptanceConfig, f: Facts) -> str | None:
    """No criterion takes a softmax of rows that are probabilities already."""
    shapes, probability_rows = f.shapes, f.probability_rows
    softmaxed = [name for name in probability_rows
                 if rule.boundary_margin_kind == "probability"
                 or (len(shapes.get(name, ())) == 2 and (rule.max_kl_mean is not None or rule.max_kl_p99 is not None))]
    if softmaxed:
        name = softmaxed[0]
        return (f"params.yaml: output '{name}' holds probabilities (every row of the FP32 reference sums to 1), but the "
                f"rule reads class scores through softmax (max_kl_mean / max_kl_p99 per token, boundary_margin_kind "
                f"probability), which on probabilities measures almost nothing; return the logits, or the log-probabilities "
                f"(softmax of log p is p), or judge '{name}' without those criteria")
    return None


def _unit_heads_named(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A single-value head whose values all lie in [0, 1] says probability or logit."""
    unit_heads = f.unit_heads
    if unit_heads:
        name = unit_heads[0]
        return (f"params.yaml: output '{name}' holds one decision per case (or token) as a single value, every one of "
                f"them in [0, 1] in the FP32 reference, so compare would read it as a probability decided at 0.5, where a "
                f"logit is decided at 0, but its name says neither; name the output so that it says which ('{name}_prob' "
                f"for a sigmoid's probability, '{name}_logit' for a logit), or give '{name}': {{decisions: false}} under "
                f"acceptance.outputs to judge its values only")
    return None


def _band_below_unit_and_spread(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A band neither reaches 1 on whole numbers nor the spread of values judged alone."""
    spreads, whole_numbers, names = f.spreads, f.whole_numbers, f.names
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
    return None


def _decided_scores_shaped(rule: AcceptanceConfig, f: Facts) -> str | None:
    """Decided scores are [N, C] or [N, T, C]: no decision check reads more dims."""
    kind, shapes, names = f.kind, f.shapes, f.names
    scored = [n for n in names if len(shapes[n]) >= 3 and (n != primary_name(names) or kind == "classification")
              and heads.scored(rule.tolerance(n), n, kind)]
    if scored:  # [N, a, b, c...]: no decision check reads it (class scores are [N, C] or [N, T, C])
        name = scored[0]
        return (f"params.yaml: output '{name}' of shape [N, {', '.join(map(str, shapes[name]))}] is named like scores (or "
                f"says decisions: true), but no decision check reads an output of {len(shapes[name]) + 1} dims, so its "
                f"decisions would go untested; return it as [N, T, classes] (classes last), or give it "
                f"'{name}': {{decisions: false}} under acceptance.outputs to judge its values only")
    return None


def _classes_last(rule: AcceptanceConfig, f: Facts) -> str | None:
    """Decided scores have their classes last, not the task's positions."""
    shapes, channels_first = f.shapes, f.channels_first
    if channels_first:
        name = min(channels_first)
        length, where = channels_first[name]
        return (f"params.yaml: output '{name}' of shape [N, {', '.join(map(str, shapes[name]))}] is decided by the argmax "
                f"of its last axis, but that axis is the task's {length} positions ({where}) and its axis 1 is not, like a "
                f"Conv1d's scores [N, classes, L], so its class flips would go uncounted; return it as [N, T, classes] "
                f"(.transpose(1, 2)), each pointer over positions (start, end logits) as an [N, T] output of its own, or "
                f"give '{name}': {{decisions: false}} under acceptance.outputs to judge its values only")
    return None


def _distribution_on_tokens(rule: AcceptanceConfig, f: Facts) -> str | None:
    """Per-token criteria (KL, top-1 agreement) judge per-token scores only."""
    kind, shapes, names = f.kind, f.shapes, f.names
    main = primary_name(names)
    distribution = [key for key in ("max_kl_mean", "max_kl_p99", "min_top1_agreement") if getattr(rule, key) is not None]
    if distribution and not (kind == "classification" and len(shapes[main]) == 2):
        return (f"params.yaml: acceptance.{distribution[0]} judges per-token scores [N, T, classes], but the "
                f"{'classifier' if kind == 'classification' else 'regression'}'s output '{main}' is "
                f"[N, {', '.join(map(str, shapes[main]))}], so every trial would roll back; set "
                f"{', '.join(distribution)} to null (flips, values and quality judge it)")
    return None


def _flip_rate_reachable(rule: AcceptanceConfig, f: Facts) -> str | None:
    """max_flip_rate can pass on this many ordinary cases."""
    kind, shapes, real_units, main = f.kind, f.shapes, f.real_units, f.main
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
    return None


def _top1_reachable(rule: AcceptanceConfig, f: Facts) -> str | None:
    """min_top1_agreement can pass on this many ordinary tokens."""
    tokens = f.tokens
    if rule.min_top1_agreement is not None and tokens is not None and rule.min_top1_agreement > 0:
        reach = 1.0 - bounds.binomial_upper(0, tokens, rule.confidence)
        if reach < rule.min_top1_agreement:
            return (f"params.yaml: acceptance.min_top1_agreement {rule.min_top1_agreement:g} at confidence "
                    f"{rule.confidence:g}: over the fixed set's {tokens} ordinary tokens the Clopper–Pearson lower bound is "
                    f"at most {reach:.6f} even when every token agrees, so every trial would roll back; give more cases "
                    f"(prepare), a min_top1_agreement of at most {reach:.4g}, or null")
    return None


def _relative_margin_meaningful(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A relative margin has at least 3 classes to spread over."""
    kind, shapes, names = f.kind, f.shapes, f.names
    if kind == "classification" and rule.boundary_margin_kind == "relative":
        few = [n for n in names if math.prod(shapes[n][-1:]) < 3 and heads.decides(rule.tolerance(n), n)]  # entries checked above
        if few:
            return (f"params.yaml: acceptance.boundary_margin_kind relative divides the top-2 margin by the spread of the "
                    f"row's scores, which for output '{few[0]}' of {math.prod(shapes[few[0]][-1:])} class score(s) is the "
                    f"margin itself (times sqrt 2): no case would ever be near the boundary; use logit or probability")
    return None


def _reference_finite(rule: AcceptanceConfig, f: Facts) -> str | None:
    """The FP32 reference's loss and gradient norm are finite at every step."""
    ref_steps = f.ref_steps
    for step in ref_steps:
        if not math.isfinite(step.loss) or not math.isfinite(step.grad_norm):
            what = "loss" if not math.isfinite(step.loss) else "gradient norm"
            return (f"the FP32 reference's {what} is not finite at step {step.step}: an incorrect FP32 run is no baseline; "
                    f"fix the model, the data or the recipe (reference.lr, reference.grad_clip), then rerun")
    return None


def _top_k_below_classes(rule: AcceptanceConfig, f: Facts) -> str | None:
    """top_k is below the number of classes, or quality could not fail."""
    kind, shapes, metric, top_k, main = f.kind, f.shapes, f.metric, f.top_k, f.main
    classes = shapes[main][-1] if kind == "classification" and shapes.get(main) else None
    if metric == "top_k" and top_k is not None and classes is not None and top_k >= classes and rule.judges_quality:
        return (f"params.yaml: task.top_k {top_k} is not below the {classes} classes output '{main}' scores, so every target "
                f"is among the top {top_k} and the quality criteria (min_quality, max_quality_drop) cannot fail; give "
                f"task.top_k below {classes}, or metric: accuracy")
    return None


def _replicates_usable(rule: AcceptanceConfig, f: Facts) -> str | None:
    """The FP32 replicates give the noise floor something to judge by."""
    ref_steps, replicate, more_replicates = f.ref_steps, f.replicate, f.more_replicates
    for each in [replicate, *more_replicates] if replicate is not None else []:
        noise = _replicate_problem(rule, ref_steps, each)
        if noise:
            return noise
    return None


def _min_quality_in_range(rule: AcceptanceConfig, f: Facts) -> str | None:
    """min_quality lies in the range of the metric in effect."""
    metric = f.metric
    span = metric_range(metric)
    if rule.min_quality is not None and not span[0] <= rule.min_quality <= span[1]:  # ``auto`` read as label_accuracy
        return (f"params.yaml: acceptance.min_quality {rule.min_quality:g} is outside [{span[0]:g}, {span[1]:g}], the range "
                f"of the quality metric in effect, {metric}; give one in that range, or name task.metric")
    return None


def _quality_defined(rule: AcceptanceConfig, f: Facts) -> str | None:
    """The reference has a finite quality where the rule judges quality."""
    ref_quality, metric, with_target = f.ref_quality, f.metric, f.with_target
    if not math.isfinite(ref_quality) and rule.judges_quality and with_target:
        return (f"the FP32 reference's quality ({metric}) is {ref_quality} over the cases with a target, so the rule's "
                f"quality criteria cannot judge any trial; fix task.metric (R2 of a constant target, for one, is undefined), "
                f"or set acceptance.max_quality_drop: null and min_quality: null to judge without quality")
    if not math.isfinite(ref_quality) and rule.judges_quality:
        return f"the FP32 reference has no quality to judge trials by: {NO_TARGET}"
    return None


def _reference_meets_quality(rule: AcceptanceConfig, f: Facts) -> str | None:
    """The reference and its replicates meet min_quality; max_quality_drop is below its error."""
    ref_quality, metric, higher_is_better, spread = f.ref_quality, f.metric, f.higher_is_better, f.spread
    if math.isfinite(ref_quality):
        if rule.min_quality is not None and (
            ref_quality < rule.min_quality if higher_is_better else ref_quality > rule.min_quality
        ):
            said = (f"the FP32 reference's quality ({metric} {ref_quality:.4g}) does not meet acceptance.min_quality "
                    f"{rule.min_quality:g}, so every trial would roll back: ")
            if rule.min_quality != 0.9:
                return said + "fix the reference (training, data) before any trial, or set the minimum it can meet"
            # params.yaml's value, the digits example's floor: a user's first run with their own model meets it here
            runs = (ref_quality, *(spread.replicates if spread else ()))
            worst = min(runs) if higher_is_better else max(runs)
            digits = 3 - math.floor(math.log10(abs(worst))) if worst else 4  # rounded towards what FP32 reaches
            bound = (math.floor if higher_is_better else math.ceil)(worst * 10**digits) / 10**digits
            side = "at most" if higher_is_better else "at least"
            return said + (f"0.9 is the digits example's floor (params.yaml); set your model's own, {side} {bound:g} (what "
                           f"the FP32 reference and its replicates reach), or min_quality: null")
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
    return None


def _loss_band(rule: AcceptanceConfig, f: Facts) -> str | None:
    """A stated per-step loss band is calibrated on FP32's own replicates."""
    return _loss_band_problem(rule, f.ref_steps, f.replicate, f.more_replicates)


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


CHECKS = (
    _outputs_named,
    _tolerances_below_scale,
    _undecided_distributions,
    _undecided_masked_scores,
    _no_argmax_across_labels,
    _logit_or_fitted_value,
    _probabilities_in_range,
    _no_softmax_of_probabilities,
    _unit_heads_named,
    _band_below_unit_and_spread,
    _decided_scores_shaped,
    _classes_last,
    _distribution_on_tokens,
    _flip_rate_reachable,
    _top1_reachable,
    _relative_margin_meaningful,
    _reference_finite,
    _top_k_below_classes,
    _replicates_usable,
    _min_quality_in_range,
    _quality_defined,
    _reference_meets_quality,
    _loss_band,
)
"""Every check, in the order freeze asks them: names and scales first, then what is decided, then what can pass."""
