"""The compare artifact of one variant (``data/compare/<variant>/``): written here, read back here, typed.

Files: ``stats.json`` (every statistic: what decide applies the rule to), ``cases.json`` (the per-case
table: every flipped case and the ``compare.table_rows`` worst others) and ``summary.json`` (flat
numbers; not a DVC metric: decide's short metrics file is); for a failed trial (it raised under its
policy: ``pipeline.artifacts.trial.Failure``), ``failed.json`` alone, the failure as the trial wrote it.
``Stats``: frozen sections, one per part of the comparison, read by attribute.
``compare.streams.compare_streams`` builds them directly (each of its accumulators gives its section:
``ValueGap``, ``Arbiter``, ``Decisions``, ``Distribution``, ``LossGap`` and ``UpdateHealth`` joined as
``Training``...) and ``write`` writes ``Stats.as_dict``; decide, diagnose, report and publish ``read``
them back through ``Stats.from_dict``, its exact inverse (it refuses a key it does not know, so a
statistic written by another version cannot go unread). Diagnosis re-runs judge the ``Stats`` of a
fresh comparison as they are. Torch-free (decide reads it without importing torch; compare imports it).

API:
    write(variant, stats: Stats, table: list[dict]) -> None
    write_failed(variant, failure: dict) -> None    a failed trial: nothing to compare
    read(variant) -> Stats                 raises UserError when compare@NAME has not run (or wrote another form)
    read_table(variant) -> list[dict]
    summary(stats: Stats) -> dict        flat numbers, written as summary.json
    Stats.from_dict(d) / Stats.as_dict()
    Stats.values[name]: ValueGap    .flips, .heads[name]: Decisions    .distribution: Distribution | None
    Stats.quality: Quality    .training: Training (.noise: Noise | None, .updates_to_fp32_loss)    .nonfinite: NonFiniteSides
    Stats.arbiter[name]: Arbiter | None    .regression[side]: RegressionErrors | None    .outputs: OutputsInfo
    Stats.max_abs_gap
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.errors import UserError
from pipeline.files import StagedFolder, read_json, write_json

STATS = "stats.json"
TABLE = "cases.json"
SUMMARY = "summary.json"
FAILED = "failed.json"


@dataclass(frozen=True)
class KindGap(Record):
    """The gap counts of one case kind (ordinary, edge, boundary, selected)."""

    elements: int
    failing: int
    max_abs: float
    max_rel: float
    nonfinite_trial_only: int


@dataclass(frozen=True)
class ValueGap(Record):
    """One named output's element-wise gap against its tolerance (``|trial - ref| > atol + rtol * |ref|`` fails)."""

    ABSENT = ("failing_ids", "zero_probability_both")

    elements: int
    failing: int
    failing_fraction: float
    nonfinite_trial_only: int
    """Elements non-finite in the trial where the reference is finite."""
    nonfinite_reference: int
    nonfinite_both: int
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    mean_rel: float
    p99_rel: float
    p99_exact: bool
    atol: float
    rtol: float
    min_passing_atol: float
    """The smallest atol (at this rtol) that would have passed, rounded up: reported, never applied."""
    min_passing_rtol: float
    per_kind: dict[str, KindGap]
    zero_probability_both: int | None = None
    """Class scores decided through softmax (``heads.decided_heads``): pairs at softmax probability exactly 0 on both
    sides (each more than ``gaps.ZERO_PROBABILITY_NATS`` below its row's maximum: a masked class, ``finfo.min`` written
    as -3.4e38 under FP32 and -65504 under float16): agreement, in ``elements`` but in no failing count and no gap
    figure, set aside wherever a slice would fail or its largest gap exceeds that many nats; absent for other outputs."""
    failing_ids: tuple[str, ...] | None = None
    """Ids of the cases with a failing element (the first 1000); absent when none failed."""


@dataclass(frozen=True)
class Arbiter(Record):
    """How far AMP is from FP64, against how far FP32 is (RMSE)."""

    ABSENT = ("cases",)

    fp32_rmse_vs_fp64: float
    amp_rmse_vs_fp64: float
    amp_over_fp32: float
    cases: int | None = None
    """The fixed set's first cases the FP64 re-run covered (``reference.fp64_arbiter``), when not all of them."""


@dataclass(frozen=True)
class OutputsInfo(Record):
    ABSENT = ("kernels", "undecided")
    cases: int
    primary: str
    per_token: bool
    shapes: dict[str, tuple[int, ...]]
    chunk_rows: int
    kernels: bool | None = None
    """True where some output's statistics ran through compare's C kernels (``compare.native``: outputs of 16.8 M
    elements and more); absent where torch computed every one."""
    undecided: tuple[str, ...] | None = None
    """Outputs judged by values alone though their targets are labels 0 or 1 (``heads.Roles.undecided``)."""


@dataclass(frozen=True)
class NonFinite(Record):
    """Rows with a non-finite element in any output of one side, by kind, with their ids (the first 1000)."""

    rows: int
    per_kind: dict[str, int]
    ids: tuple[str, ...]
    elements: dict[str, int]
    """Non-finite elements per output (outputs with none left out)."""


@dataclass(frozen=True)
class NonFiniteSides(Record):
    trial: NonFinite
    """The policy's inference on the trained reference."""
    trained: NonFinite
    """The model trained under the policy."""


@dataclass(frozen=True)
class Flip(Record):
    """One changed decision: a case (per token, ``position``) whose class (or threshold side) differs.

    Classification flips carry the classes, margins and scores (the top 5 for a vocabulary); regression
    flips the first value of the case that crossed the threshold, on each side. Fields that do not apply are
    absent from the file."""

    ABSENT = ("reference_class", "trial_class", "reference_margin", "trial_margin", "margin_kind", "position",
              "reference_scores", "trial_scores", "reference_top", "trial_top", "kl", "reference", "trial")

    id: str
    kind: str
    boundary: bool
    """A constructed boundary case (kind ``boundary``), limited apart."""
    near_boundary: bool
    """A real case whose reference margin is below the rule's ``boundary_margin``."""
    reference_class: int | None = None
    trial_class: int | None = None
    reference_margin: float | None = None
    trial_margin: float | None = None
    margin_kind: str | None = None
    position: int | None = None
    reference_scores: tuple[float, ...] | None = None
    trial_scores: tuple[float, ...] | None = None
    reference_top: tuple[tuple[int, float], ...] | None = None
    trial_top: tuple[tuple[int, float], ...] | None = None
    kl: float | None = None
    reference: float | None = None
    trial: float | None = None

    @property
    def label(self) -> str:
        """The id, per token ``id@position``."""
        return self.id if self.position is None else f"{self.id}@{self.position}"


@dataclass(frozen=True)
class Decisions(Record):
    """Decisions of one head compared (per case, or per token): flips counted in three exact groups."""

    ABSENT = ("margin_kind", "boundary_margin")

    cases: int
    boundary_cases: int
    near_boundary_cases: int
    flips: int
    """Flips of real cases away from the boundary."""
    near_boundary_flips: int
    boundary_flips: int
    unit: Literal["case", "token"]
    boundary_flip_fraction: float
    real_flips: int
    """Flips of real cases, near the boundary or not."""
    flip_list: tuple[Flip, ...]
    flip_list_dropped: int
    sample: int
    """The units a flip rate is bounded on: the ordinary cases' (per token, their kept positions), the one independent
    draw of the data (``compare.decisions.rate_sample``)."""
    sample_flips: int
    """The changed decisions counted against ``sample``: the ordinary cases', and the edge and selected cases' beyond
    those of their ordinary twin."""
    margin_kind: str | None = None
    """Unit of the boundary margin (classification only)."""
    boundary_margin: float | None = None

    def labels(self, boundary: bool, near: bool | None = None) -> list[str]:
        """Labels of the listed flips of constructed (``boundary``) or real cases; ``near`` filters real ones."""
        return [f.label for f in self.flip_list if f.boundary == boundary and (near is None or f.near_boundary == near)]


@dataclass(frozen=True)
class Distribution(Record):
    """Per-token outputs: KL(reference || trial) per token and top-1 / top-k agreement, over the ordinary cases' tokens
    (the flip rate's sample, ``Decisions.sample``); ``kl_max`` over every real token."""

    tokens: int
    kl_mean: float
    kl_p99: float
    kl_p99_upper: float
    """Never below the exact p99 (a streamed quantile's bucket edge): what the rule gates on."""
    kl_p99_exact: bool
    kl_max: float
    top1_agreement: float
    top_k: int
    top_k_overlap: float
    kl_mean_se: float
    """Standard error of ``kl_mean`` (the tokens' sample standard deviation over sqrt(tokens))."""
    kl_quantiles: dict[str, float]
    """The KL quantiles llama.cpp reports: max, p99.9, p99, p95, p90, median (nearest rank)."""
    kl_quantiles_exact: bool
    """Whether every quantile is exact (else some is a streamed estimate, within 2**-11 relative)."""
    top1_agreement_se: float
    """Binomial standard error of ``top1_agreement``: sqrt(a (1 - a) / tokens)."""
    rms_delta_p: float | None
    """RMS over the tokens with a target of the change of its probability, trial - reference (None: no targets)."""
    store: dict[str, str]
    """Per side (reference, trial): the store its scores were read from, ``full`` or ``compact``."""
    logit_error: float
    """Largest error of a decoded score in a compact store (0.0 when both sides are full: every number is exact)."""
    kl_mean_bound: float
    """Largest error of ``kl_mean`` that the stores allow (``compare.decisions.kl_bound``); the rule adds it."""
    kl_p99_bound: float
    """Largest error of KL's p99 (at ``kl_p99_upper``) that the stores allow; the rule adds it."""
    kl_max_bound: float


@dataclass(frozen=True)
class Paired(Record):
    """Targets one side lost and gained against the reference, case by case."""

    lost: int
    gained: int


@dataclass(frozen=True)
class FP32Spread(Record):
    """Quality after training of the FP32 reference and of its replicate(s) on the fixed set, as freeze's scan measured
    them (compare's metric): how far FP32 itself moves when trained again, against which AMP's quality after training
    is judged (``bounds.fp32_drop_allowed``)."""

    metric: str
    reference: float
    replicates: tuple[float, ...]


@dataclass(frozen=True)
class Quality(Record):
    ABSENT = ("perplexity", "columns", "fp32_spread")

    metric: str
    higher_is_better: bool
    reference: float
    trial: float
    trained: float
    counts: dict[str, tuple[int, int]]
    """Per side, (hits, targets) where the metric counts (accuracy, top_k)."""
    paired: dict[str, Paired]
    perplexity: dict[str, float | None] | None = None
    columns: dict[str, tuple[float, ...]] | None = None
    """Per side, the metric of each column of a regression output of a few columns (``quality.COLUMNS``), else absent."""
    fp32_spread: FP32Spread | None = None
    """FP32's own quality after training, reference and replicate(s) (freeze), where a replicate ran: the yardstick of
    the quality after training."""

    def of(self, side: Literal["reference", "trial", "trained"]) -> float:
        return getattr(self, side)


@dataclass(frozen=True)
class RegressionErrors(Record):
    ABSENT = ("output_min", "output_max")

    mae: float
    rmse: float
    max_error: float
    extreme_low_mae: float
    extreme_high_mae: float
    output_min: float | None = None
    output_max: float | None = None


@dataclass(frozen=True)
class Noise(Record):
    """The FP32 noise floor: the replicate's per-step gap to the reference beside AMP's, and the band on the curves."""

    ABSENT = ("over", "stated_multiple")

    replicate_gap: tuple[float, ...]
    amp_gap: tuple[float, ...]
    max_replicate_gap: float
    mean_replicate_gap: float
    mean_amp_gap: float
    max_amp_gap: float
    multiple: float | None
    atol: float | None
    violations: int
    first_violation_step: int
    worst_ratio: float
    mean_ratio: float
    over: tuple[str, ...] | None = None
    """Which curve statistics (mean, max) are over the band, when the rule sets one."""
    stated_multiple: float | None = None
    """The rule's ``loss_noise_multiple`` where FP32's own replicates needed more against each other (``multiple`` is
    then theirs: ``trajectory.fp32_multiple``)."""


@dataclass(frozen=True)
class LossGap(Record):
    """The trial's per-step loss against the reference's band (``compare.trajectory.trajectory_gap``)."""

    ABSENT = ("noise",)

    steps: int
    band_violations: int
    first_violation_step: int
    max_loss_gap: float
    max_loss_gap_step: int
    final_loss_reference: float
    final_loss_trial: float
    noise: Noise | None = field(default=None, kw_only=True)
    """Set when a replicate trajectory (the noise floor) was compared too."""
    excused_steps: tuple[int, ...] = field(default=(), kw_only=True)
    """Steps whose loss was not finite and whose update the GradScaler skipped: one incident, not measured by the
    band (the guide: « un incident ponctuel ne suffit pas »); the skip limits, the stall check and quality judge them."""


@dataclass(frozen=True)
class FinalLoss(Record):
    """Where training ended: the trial's loss over its last ``window`` steps beside FP32's own runs' (the reference's
    first, then each replicate's), whose spread says how far FP32 itself ends when trained again
    (``compare.trajectory.final_loss``)."""

    window: int
    amp: float
    fp32: tuple[float, ...]


@dataclass(frozen=True)
class UpdatesToLoss(Record):
    """How many real updates each run needed to reach FP32's final loss (``target``, the reference's ``FinalLoss``): the
    first step at which its loss, averaged over the ``window`` steps up to it (as ``FinalLoss`` averages the last
    ones), is at or below ``target``; None when it never is (``compare.trajectory.updates_to_fp32_loss``)."""

    target: float
    window: int
    of: int
    """The trial's real updates in all."""
    amp: int | None
    """The trial's real updates through the step that reached ``target`` (a skipped update is no real one)."""
    amp_steps: int | None
    """The trial's steps through that step, skipped ones included: each costs a step's time."""
    fp32: int | None
    """The reference's, by the same rule: at its last step at the latest (its smoothed loss there IS ``target``),
    earlier where its averaged curve dipped to it before."""
    fp32_replicates: tuple[int | None, ...]
    """Each FP32 replicate's, on its own data order: how far FP32 itself moves (empty where none ran)."""


@dataclass(frozen=True)
class UpdateHealth(Record):
    """Whether the trial's updates were real (``compare.trajectory.update_health``)."""

    nonfinite_grad_steps: tuple[int, ...]
    """Steps whose gradient norm was not finite with no GradScaler to skip them (not applied)."""
    skipped_steps: int
    skipped_fraction: float
    recent_skipped_steps: int
    """Skipped updates among the last ``stall_window`` steps: skips bunched at the end, which the whole run's
    fraction dilutes, are a scale still falling."""
    real_updates: int
    stalled: bool
    stall_window: int
    final_scale: float
    min_scale: float
    first_nonfinite_loss_step: int
    calibration_steps: int = field(default=0, kw_only=True)
    """Skips that opened the run before its first real update, at a finite loss (the GradScaler calibrating its scale):
    ``skipped_fraction`` and ``recent_skipped_steps`` count the skips after them; ``skipped_steps`` counts every skip."""


@dataclass(frozen=True, kw_only=True)
class Training(UpdateHealth, LossGap):
    """The trial's trajectory against the reference's (or FP32 aligned on its skips) and its updates' health:
    one flat section in the file, the loss gap's fields and the health's, and how the trial ran."""

    ABSENT = ("noise", "final", "updates_to_fp32_loss")

    scaler_enabled: bool
    aligned_on_skips: bool
    first_nonfinite_reference_step: int
    final: FinalLoss | None = None
    """The final losses, where FP32 replicates ran."""
    updates_to_fp32_loss: UpdatesToLoss | None = None
    """The real updates the trial, the reference and each replicate needed to reach FP32's final loss (benchmark's time
    to quality); absent where the reference's final loss is not finite."""

    @classmethod
    def of(cls, gap: LossGap, health: UpdateHealth, **run) -> "Training":
        """``gap`` and ``health`` joined, with ``run``'s fields (scaler_enabled, aligned_on_skips, ...)."""
        parts = {f.name: getattr(p, f.name) for p in (gap, health) for f in fields(p)}
        return cls(**parts, **run)


@dataclass(frozen=True)
class Stats(Record):
    """Compare's statistics of one trial, typed: what the rule judges and the renderers show."""

    ABSENT = ("env_differs_from_reference",)

    values: dict[str, ValueGap]
    arbiter: dict[str, Arbiter] | None
    outputs: OutputsInfo
    nonfinite: NonFiniteSides
    heads: dict[str, Decisions]
    """Decided outputs other than the primary one."""
    flips: Decisions
    """The primary output's decisions (regression: threshold crossings)."""
    distribution: Distribution | None
    quality: Quality
    regression: dict[str, RegressionErrors] | None
    training: Training
    env_differs_from_reference: tuple[str, ...] | None = None
    """Set by the compare stage (the trial's manifest), not by the statistics."""

    @property
    def max_abs_gap(self) -> float:
        return max((g.max_abs for g in self.values.values()), default=0.0)


def summary(stats: Stats) -> dict:
    """Flat numbers (``summary.json``): the largest gaps per output, the flips, quality, training."""
    out: dict[str, float | int] = {}
    for name, g in stats.values.items():
        out |= {f"values.{name}.max_abs": g.max_abs, f"values.{name}.p99_abs": g.p99_abs, f"values.{name}.max_rel": g.max_rel,
                f"values.{name}.failing_fraction": g.failing_fraction,
                f"values.{name}.nonfinite_trial_only": g.nonfinite_trial_only,
                f"values.{name}.min_passing_atol": g.min_passing_atol}
    for name, a in (stats.arbiter or {}).items():
        out[f"arbiter.{name}.amp_over_fp32"] = a.amp_over_fp32
    f = stats.flips
    out |= {"decisions.flips": f.flips, "decisions.near_boundary_flips": f.near_boundary_flips,
            "decisions.boundary_flips": f.boundary_flips, "decisions.boundary_cases": f.boundary_cases}
    q = stats.quality
    out |= {"quality.reference": q.reference, "quality.trial": q.trial, "quality.trained": q.trained}
    if (d := stats.distribution) is not None:
        out |= {"distribution.kl_mean": d.kl_mean, "distribution.kl_p99": d.kl_p99, "distribution.kl_max": d.kl_max,
                "distribution.top1_agreement": d.top1_agreement, "distribution.top_k_overlap": d.top_k_overlap,
                "distribution.kl_mean_se": d.kl_mean_se, "distribution.top1_agreement_se": d.top1_agreement_se,
                "distribution.kl_mean_bound": d.kl_mean_bound}
        if d.rms_delta_p is not None:
            out["distribution.rms_delta_p"] = d.rms_delta_p
    t = stats.training
    out |= {"training.max_loss_gap": t.max_loss_gap, "training.band_violations": t.band_violations,
            "training.skipped_fraction": t.skipped_fraction, "training.real_updates": t.real_updates,
            "training.final_scale": t.final_scale, "training.final_loss_reference": t.final_loss_reference,
            "training.final_loss_trial": t.final_loss_trial}
    return out


def write(variant: str, stats: Stats, table: list[dict]) -> None:
    """``stats`` as compare produced it, as ``Stats.as_dict`` gives it (the form ``read`` reads back); the three files
    replace the folder all together (``files.StagedFolder``)."""
    with StagedFolder(paths.compare(variant)) as out:
        write_json(out / STATS, stats.as_dict())
        write_json(out / TABLE, table)
        write_json(out / SUMMARY, summary(stats))


def write_failed(variant: str, failure: dict) -> None:
    """A failed trial has no outputs to compare: ``failed.json`` says so with its failure (``trial.Failure.as_dict``),
    and what an earlier comparison left here goes (the folder is replaced)."""
    with StagedFolder(paths.compare(variant)) as out:
        write_json(out / FAILED, failure)


def read(variant: str) -> Stats:
    """Raises: UserError when compare@NAME has not run, or its stats.json is not in this version's form."""
    path = paths.compare(variant) / STATS
    try:
        return Stats.from_dict(read_json(path, f"compare@{variant}"))
    except ValueError as e:
        raise UserError(f"{path} is not in the form this version reads ({e}); run `dvc repro compare@{variant}`") from None


def read_table(variant: str) -> list[dict]:
    return read_json(paths.compare(variant) / TABLE, f"compare@{variant}")
