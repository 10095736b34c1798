"""Assemble the comparison of one trial against the reference from the pure numerics, chunk by chunk.

Reference, trial, trained-trial and FP64 outputs are read one chunk of rows at a time (``Source``:
an ``outputs.OutputsReader`` on a file, full or compact (``compare.store``: decoded as read; the distribution
section records each side's store, and the bounds its errors allow, which the rule adds; the value gap of a compact
output is counted at ``conservative_atol``), or ``InMemory`` on tensors already loaded); the accumulators of
``gaps``, ``decisions`` and ``quality`` keep the statistics, so memory is one chunk of each source plus a few numbers per case,
whatever the fixed set's size. Kinds (ordinary, edge, boundary) are computed once from the ids.

Speed (``scripts/bench_compare.py``): a file's chunk is mapped, not copied, and its pages released once
used; statistics run on slices of ``SLICE_ELEMENTS`` (cache-sized temporaries), the failing count in
float32 (float64 only near the threshold), p99s from a bit-pattern histogram past 6.5e6 elements
(``quantiles.StreamQuantile``, past its cut only the values that can still be the answer), no copy of a slice
whose cases all have a target, finiteness from a sum (element-wise only where it is not finite), labels and the
best two per case from numpy's ``argmax`` (``decisions.first_max``), trial - reference once for the gap and KL,
KL's dot products as a product and a sum (not ``bmm``), NLL from ``log_softmax`` (one fused pass), a one-row
slice's largest gap taken from the gap's own maximum (``GapStats.last_max``), and the slices' temporaries kept on
the heap between slices (``_keep_freed_memory``: no page fault per slice). On a GPU (``device``) each chunk is
copied there and computed whole.

Out: the statistics, typed (``artifacts.comparison.Stats``: what decide reads; ``comparison.write`` writes
them) and the per-case table,
which keeps every flipped case and the ``table_rows`` worst others (counts stay exact in the stats).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch

from pipeline.artifacts.comparison import (Decisions, FP32Spread, NonFinite, NonFiniteSides, OutputsInfo, Paired, Quality,
                                           Stats, Training)
from pipeline.artifacts import compact
from pipeline.artifacts.outputs import OutputsReader
from pipeline.artifacts.steps import Steps
from pipeline.compare import native
from pipeline.compare.decisions import (DecisionStats, PerCase, first_crossing, holds_probabilities, labels_and_lse,
                                        regression_flips, sign_flips)
from pipeline.compare.gaps import ArbiterStats, GapStats, all_finite, broken
from pipeline.compare.quality import QualityStats, regression_errors
from pipeline.compare.trajectory import calibration_steps, final_loss, trajectory_gap, update_health, updates_to_fp32_loss
from pipeline import heads
from pipeline.config import METRICS, AcceptanceConfig, CompareConfig, TaskConfig
from pipeline.heads import decided_heads, primary_name, score_heads, sign_heads
from pipeline.errors import UserError
from pipeline.task import (IGNORE_INDEX, binary_targets, judged_positions, labelled_positions, mask_padding, masked_targets,
                           resolve, rows_within, scores_over_positions)


SIDES = ("reference", "trial", "trained")
"""The outputs compared: the reference's, the trial's (the policy's inference on the trained reference) and
those of the model trained under the policy."""


class Source(Protocol):
    """Named per-case outputs readable by slices of rows (``outputs.OutputsReader`` is one)."""

    names: list[str]
    rows: int

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, start: int, stop: int) -> torch.Tensor: ...


class InMemory:
    """A ``Source`` over tensors already in memory (small sets, diagnosis re-runs, tests)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.names = sorted(tensors)
        self.rows = next(iter(tensors.values())).shape[0] if tensors else 0

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)


@dataclass(frozen=True)
class Metric:
    """The quality metric in effect: its name, direction, k of top_k, and the function of a user metric."""

    name: str
    higher_is_better: bool = True
    top_k: int = 5
    function: Callable | None = None
    task: TaskConfig | None = None
    """The task it is for: its loss says how a regression's primary is decided (``reading``), and ``metric: auto``
    what scores it."""
    decided_at: tuple[float, float] | None = None
    """``label_accuracy``: the threshold each value is decided at, and the one its target is (0.5 for labels 0 or 1)."""

    @classmethod
    def for_task(cls, task: TaskConfig) -> "Metric":
        """The metric ``task`` names (``auto`` resolved by its kind); a user metric's function imported."""
        name = task.metric_name
        function = None if name in METRICS else resolve(name, "task.metric")
        return cls(name=name, higher_is_better=task.higher_is_better, top_k=task.top_k, function=function, task=task)

    def reading(self, kind: str, rule: AcceptanceConfig, primary: str, shape: tuple[int, ...], targets: torch.Tensor,
                has_target: torch.Tensor) -> tuple[float | None, "Metric"]:
        """How the primary ``primary`` of ``shape`` [N, ...] is read: the threshold a regression decides it at
        (``heads.decision_threshold``; a value the loss fits to 0/1 labels, ``TaskConfig.fits_values``, at
        0.5), and the metric that scores it. Under ``metric: auto``, a regression decided at a threshold on targets that
        are labels (``task.binary_targets``) is scored by ``label_accuracy``, the fraction of its values on their label's
        side: an RMSE of logits against 0/1 labels rewards a model that answers 0.5 everywhere."""
        labels = binary_targets(targets, has_target)
        width = shape[-1] if len(shape) >= 2 else 1
        fitted = self.task is not None and self.task.fits_values(width)
        threshold = heads.decision_threshold(rule, kind, primary, labels, fitted, width,
                                             self.task.loss if self.task is not None else "")
        name = self.name
        if self.task is not None and self.task.metric == "auto" and threshold is not None and labels:
            name = "label_accuracy"
        if name != "label_accuracy":
            return threshold, self
        if threshold is None:
            raise UserError(f"params.yaml: task.metric is label_accuracy but output '{primary}' is decided at no threshold; "
                            f"set acceptance.threshold, or another task.metric")
        return threshold, replace(self, name=name, decided_at=(threshold, 0.5 if labels else threshold))

    def quality(self, tie_rule: str) -> QualityStats:
        """A fresh accumulator of this metric."""
        return QualityStats(self.name, tie_rule, self.top_k, self.function, self.decided_at)


def kinds_of(ids: Sequence[str]) -> list[str]:
    """Kind of every case id (``ordinary/...`` -> ``ordinary``), computed once."""
    return [i.partition("/")[0] for i in ids]


def _runs(kinds: list[str], start: int, stop: int) -> list[tuple[int, int, str]]:
    """Maximal runs of one kind within rows start:stop, as (start, stop, kind), in row order."""
    runs, s = [], start
    for i in range(start + 1, stop + 1):
        if i == stop or kinds[i] != kinds[s]:
            runs.append((s, i, kinds[s]))
            s = i
    return runs


@dataclass(frozen=True)
class Sources:
    """What one comparison reads case by case: the fixed set's ids and targets, and each side's outputs."""

    ids: Sequence[str]
    targets: torch.Tensor
    """Per case [N, ...], per token [N, T] (-100: ignored); ``has_target`` says which rows hold one."""
    has_target: torch.Tensor
    reference: Source
    trial: Source
    trained: Source
    """The outputs of the model the trial trained (the training side of the verdict)."""
    fp64: Source | None = None
    """The FP64 arbiter's outputs, when the reference recorded them."""
    token_mask: torch.Tensor | None = None
    """The batch's ``attention_mask`` [N, T] (``token_mask_of``): positions where it is 0 are ignored."""

    def __post_init__(self) -> None:
        n, rows = len(self.ids), (self.reference.rows, self.trial.rows, self.trained.rows)
        if any(r != n for r in rows):
            raise ValueError(f"outputs hold {rows[0]}/{rows[1]}/{rows[2]} rows (reference/trial/trained) for {n} cases")


@dataclass(frozen=True)
class Trajectories:
    """The training side: per-step records (``loss``, ``skipped``, ``scale``...) of the runs compared."""

    reference: Steps
    trial: Steps
    final_scale: float
    """The trial's loss scale after its last step."""
    scaler_enabled: bool = True
    replicate: Steps | None = None
    """FP32 again on another data order: FP32's own run-to-run variation, the noise floor."""
    aligned: Steps | None = None
    """FP32 with the trial's GradScaler skips skipped too (``training.aligned_fp32``): the trial is held against
    it instead of ``reference``, so that designed skips are not judged as precision."""
    spread: FP32Spread | None = None
    """FP32's own quality after training, reference and replicate (freeze): the yardstick of the quality after training."""
    more_replicates: tuple[Steps, ...] = ()
    """The FP32 replicates after ``replicate``, each on its own data order."""


def compare_streams(kind: str, rule: AcceptanceConfig, sources: Sources, trajectories: Trajectories, *,
                    metric: Metric | None = None, cfg: CompareConfig | None = None,
                    device: torch.device | str | None = None, roles: heads.Roles | None = None) -> tuple[Stats, list[dict]]:
    """Statistics and per-case table of one trial; each source read once, one chunk of rows at a time.

    Per-token outputs ignore the padding, positions where ``sources.token_mask`` is 0, in everything (a padding
    position is no output the application uses: whatever the trial computes there is not judged). The per-token
    primary's decisions and distributions also ignore the positions whose target is -100, and, without a token mask,
    so do its values and finiteness (``task.judged_positions``): with one, a real position without a target (a
    sequence's last, which generation reads next) is still judged by its values and finiteness.
    ``metric`` defaults to the kind's built-in one (``TaskConfig.metric_name``).
    ``device``: where the arithmetic runs (default the CPU); on a GPU each chunk is copied there and computed
    whole, host memory still one chunk; the statistics are the CPU's within float32 rounding.
    ``roles``: the reference's role table (``heads.Roles``, recorded by freeze); None: inferred here, as freeze does.
    """
    cfg = cfg or CompareConfig()
    device = torch.device(device or "cpu")
    metric = metric or Metric.for_task(TaskConfig(kind=kind))
    ids, ref, trial, trained, fp64 = list(sources.ids), sources.reference, sources.trial, sources.trained, sources.fp64
    kinds = kinds_of(ids)
    n = len(ids)
    targets, has_target = masked_targets(sources.targets, sources.token_mask), sources.has_target
    names = heads.judged(rule, sorted(ref.names))  # (role ignored: never read)
    main = primary_name(names)
    shapes = {name: tuple(ref.shape(name)) for name in names}
    step = rows_within(cfg.chunk_elements, sum(math.prod(s[1:]) for s in shapes.values()))
    errors = {name: (logit_error(ref, name), logit_error(trial, name)) for name in names}
    if roles is None:  # (diagnose's replays and unit tests: inferred as freeze did)
        argmax, scores = decided_heads(kind, rule, shapes, main), score_heads(kind, rule, shapes, main)
        labelled, over = sign_heads(kind, rule, shapes, main), heads.position_names(kind, rule, shapes, main)
    else:  # freeze's table: what the reference recorded
        argmax, scores, labelled, over = roles.judged_as()
    positions = position_heads(kind, rule, shapes, main, targets, has_target, sources.token_mask, over)
    gaps = {name: GapStats(conservative_atol(rule.tolerance(name).atol, rule.tolerance(name).rtol, *errors[name]),
                           rule.tolerance(name).rtol, math.prod(shapes[name]), softmax=name in argmax,  # class scores
                           scores_only=name in scores)
            for name in names}
    signs = {name: ([], [], [], []) for name in labelled}
    arbiter = {name: ArbiterStats() for name in names} if fp64 is not None else None
    main_shape = shapes[main]
    per_token = kind == "classification" and len(main_shape) == 3
    decisions = None
    if kind == "classification":
        tokens = main_shape[0] * (main_shape[1] if per_token else 1)
        decisions = DecisionStats(ids, kinds, rule.tie_rule, rule.boundary_margin, rule.boundary_margin_kind, tokens,
                                  top_k=metric.top_k, max_listed=cfg.max_listed_flips, device=device,
                                  kernels=native.wanted(math.prod(main_shape), device))
        decisions.logit_error = errors[main]
        decisions.stores = {"reference": store_of(ref), "trial": store_of(trial)}
    head_stats = {name: DecisionStats(ids, kinds, rule.tie_rule, rule.boundary_margin, rule.boundary_margin_kind,
                                      math.prod(shapes[name][:-1]), top_k=metric.top_k, max_listed=cfg.max_listed_flips,
                                      device=device)
                  for name in argmax if name != main}
    threshold, metric = metric.reading(kind, rule, main, shapes[main], targets, has_target)
    threshold = threshold if roles is None else roles.threshold
    for source in (ref, trial, trained) if metric.name == "top_k" else ():  # (a compact store keeps the k best exactly)
        if isinstance(source, OutputsReader):
            source.check_top_k(main, metric.top_k)
    quality = {side: metric.quality(rule.tie_rule) for side in SIDES}
    row_gap = torch.zeros(n, dtype=torch.float64)
    first_values: dict[str, list[torch.Tensor]] = {side: [] for side in SIDES}
    kernels = any(g.kernels for g in gaps.values()) or bool(decisions and decisions.kernels)  # (``native``: by size)
    state = _State(names=names, main=main, kind=kind, per_token=per_token, kinds=kinds, targets=targets.to(device),
                   has_target=has_target.bool().to(device), gaps=gaps, arbiter=arbiter, decisions=decisions, quality=quality,
                   row_gap=row_gap, first_values=first_values, heads=head_stats, signs=signs, device=device,
                   positions={name: real.to(device) for name, real in positions.items()},
                   threshold=threshold, ties=rule.tie_rule == "tie_is_flip",
                   judged={name: _to(judged_positions(shapes[name], per_token and name == main, targets, sources.token_mask,
                                                        primary=name == main),
                                     device) for name in names},
                   slice_elements=(max(cfg.chunk_elements, SLICE_ELEMENTS) if device.type != "cpu" else KERNEL_SLICE_ELEMENTS
                                   if kernels else SLICE_ELEMENTS),
                   nonfinite={side: torch.zeros(n, dtype=torch.bool) for side in ("trial", "trained")},
                   nonfinite_elements={side: dict.fromkeys(names, 0) for side in ("trial", "trained")})
    _keep_freed_memory()
    for start in range(0, n, step):  # one chunk of every source in memory at a time
        _chunk(state, ref, trial, trained, fp64, start, min(start + step, n))
        state.release()
        _give_back_freed_memory()

    values = {name: gaps[name].result() for name in names}
    for name, rows in state.failing_rows.items():
        values[name] = replace(values[name], failing_ids=tuple(ids[i] for i in torch.nonzero(rows).flatten().tolist()[:1000]))
    firsts = [torch.cat(first_values[side]) if first_values[side] else torch.zeros(0, dtype=torch.float64) for side in SIDES]
    ref_first, trial_first, _ = firsts  # regression: the first output of each case, per side
    regression = None
    if decisions is not None:
        flips, distribution = decisions.result(), decisions.distribution()
    else:
        picked = [torch.cat(state.crossing[side])[:, None] if state.crossing[side] else first[:, None]
                  for side, first in (("reference", ref_first), ("trial", trial_first))]
        several = math.prod(shapes[main][1:]) > 1  # a multi-label head: each flip names its label
        labels = torch.cat(state.crossing["label"]).tolist() if several and state.crossing["label"] else None
        flips = regression_flips(ids, kinds, *picked, state.threshold, rule.boundary_margin, rule.boundary_margin_kind,
                                 heads.says_probability(main), rule.tie_rule, cfg.max_listed_flips, labels=labels)
        distribution = None
        idx = torch.nonzero(has_target).flatten()
        regression = {side: regression_errors(first[idx][:, None], targets[idx]) for side, first in zip(SIDES, firsts)}
    covered = fp64.rows if fp64 is not None and fp64.rows < n else None  # a partial FP64 re-run says how many cases
    stats = Stats(
        values=values,
        arbiter=None if arbiter is None else {name: a.result(covered) for name, a in arbiter.items()},
        outputs=OutputsInfo(cases=n, primary=main, per_token=per_token, shapes=shapes, chunk_rows=step, kernels=kernels or None,
                            undecided=(roles.undecided or None) if roles is not None else None),
        nonfinite=NonFiniteSides(*(nonfinite_summary(ids, kinds, state.nonfinite[side], state.nonfinite_elements[side])
                                   for side in ("trial", "trained"))),
        heads=dict(sorted({**{name: h.result() for name, h in head_stats.items()},
                           **{name: _sign_result(ids, kinds, name, shapes[name], sides, rule, cfg)
                              for name, sides in signs.items()}}.items())),
        flips=flips,
        distribution=distribution,
        quality=replace(quality_stats(metric, per_token, quality, state.paired), fp32_spread=trajectories.spread),
        regression=regression,
        training=training_stats(rule, trajectories),
    )
    table = case_table_rows(ids, kinds, flips, row_gap, decisions.per_case() if decisions is not None else None,
                            (ref_first, trial_first) if decisions is None else None, cfg.table_rows)
    return stats, table


def store_of(source: Source) -> str:
    """``compact`` for a file in the compact store (``artifacts.compact``), else ``full``."""
    return source.store if isinstance(source, OutputsReader) else "full"


def stored_rows(source: Source, name: str, margin_kind: str, start: int, stop: int, p: int | None = None,
                q: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The log-sum-exp and live spread that a compact store keeps of rows ``start:stop`` (positions ``p:q``) of
    ``name``, which its probability and relative margins read (``DecisionStats.update``); None when stored full, or
    when the margin reads neither."""
    if margin_kind not in ("probability", "relative") or not isinstance(source, OutputsReader) or name not in source.compact:
        return None
    lse, spread = (source.read(compact.part(name, w), start, stop) for w in ("lse", "spread"))
    return (lse, spread) if p is None else (lse[:, p:q], spread[:, p:q])


def stored_kl(source: Source, name: str, start: int, stop: int, p: int | None = None,
              q: int | None = None) -> torch.Tensor | None:
    """Each token's KL(reference || trial) of rows ``start:stop`` (positions ``p:q``) of ``name`` as a compact trial keeps
    it (``decisions.token_kl`` of the full scores, ``OutputsReader.kl``), which ``DecisionStats.update`` reads in place
    of the decoded scores'; None where the trial keeps none (stored full, or compact beside a compact reference)."""
    kl = source.kl(name, start, stop) if isinstance(source, OutputsReader) else None
    return kl if kl is None or p is None else kl[:, p:q]


def logit_error(source: Source, name: str) -> float:
    """The largest error of a decoded score of ``name`` in ``source`` (0.0 unless it is stored compact)."""
    return source.logit_error(name) if isinstance(source, OutputsReader) else 0.0


def conservative_atol(atol: float, rtol: float, ref_error: float, trial_error: float) -> float:
    """The atol applied to decoded scores known within ``ref_error`` and ``trial_error`` (compact stores): an
    element within it, |t' - r'| <= atol' + rtol |r'|, is within the rule's on the original scores, since
    |t - r| <= |t' - r'| + ref_error + trial_error and rtol |r| >= rtol (|r'| - ref_error). ``atol`` itself when full."""
    if not ref_error and not trial_error:
        return atol
    return max(atol - trial_error - ref_error * (1.0 + rtol), 0.0)


def quality_stats(metric: Metric, per_token: bool, quality: dict[str, QualityStats], paired: dict[str, list[int]]) -> Quality:
    """The quality section from each side's ``QualityStats`` and the paired [lost, gained] counts."""
    perplexity = None
    if per_token and quality["reference"].perplexity() is not None:
        perplexity = {side: q.perplexity() for side, q in quality.items()}
    columns = {side: q.columns() for side, q in quality.items()}
    return Quality(
        metric=metric.name if not per_token or metric.name != "accuracy" else "token_accuracy",
        higher_is_better=metric.higher_is_better,
        **{side: q.result() for side, q in quality.items()},
        counts={side: q.counts() for side, q in quality.items() if q.counts() is not None},
        paired={side: Paired(lost=v[0], gained=v[1]) for side, v in paired.items()},
        perplexity=perplexity,
        columns=columns if all(c is not None for c in columns.values()) else None,
    )


@dataclass(kw_only=True)
class _State:
    """What one comparison accumulates chunk by chunk (built by keyword: ``compare_streams``)."""

    names: list[str]
    main: str
    kind: str
    per_token: bool
    kinds: list[str]
    targets: torch.Tensor
    has_target: torch.Tensor
    gaps: dict
    arbiter: dict | None
    decisions: DecisionStats | None
    quality: dict
    row_gap: torch.Tensor
    first_values: dict
    heads: dict = field(default_factory=dict)
    """DecisionStats of every decided output other than the primary (``decided_heads``)."""
    threshold: float | None = None
    """A regression's decision threshold (``heads.decision_threshold``)."""
    ties: bool = False
    """``tie_rule: tie_is_flip``: a value exactly at ``threshold`` on one side only is a flip."""
    crossing: dict = field(default_factory=lambda: {"reference": [], "trial": [], "label": []})
    """Per side, slice by slice: the value of each case judged against ``threshold`` (``_threshold_pick``); ``label``:
    its index among the case's values."""
    signs: dict = field(default_factory=dict)
    """Per single-logit head (``sign_heads``): its reference and trial values, slice by slice, and per token the row
    and position of each (the kept positions only)."""
    nonfinite: dict = field(default_factory=dict)
    """Per side (trial, trained): rows with a non-finite element in any output."""
    nonfinite_elements: dict = field(default_factory=dict)
    failing_rows: dict = field(default_factory=dict)
    """Per output: rows with an element outside tolerance (set only where some element failed)."""
    paired: dict = field(default_factory=dict)
    """Per side (trial, trained): [lost, gained] targets versus the reference, case by case (accuracy, top_k)."""
    merges: int = 0
    buffers: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    """Where the arithmetic runs: each chunk read is copied there (the per-case records stay on the CPU)."""
    judged: dict = field(default_factory=dict)
    """Per output, the positions [N, T] whose values and finiteness count (``task.judged_positions``), or None: all."""
    positions: dict = field(default_factory=dict)
    """Per output read as scores over positions (``position_heads``): its real positions [N, T], padding read as -inf."""
    slice_elements: int = 0
    """Elements per computation slice (``SLICE_ELEMENTS`` on a CPU, ``KERNEL_SLICE_ELEMENTS`` through the kernels; a
    whole chunk on a GPU)."""
    mapped: list = field(default_factory=list)
    read_here: dict = field(default_factory=dict)
    """The chunk's tensors by (source, name): a source that is several sides (the reference compared with itself,
    in diagnose) is read and decoded once a chunk. Nothing writes into them."""

    def read(self, source: Source, side: str, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of ``name`` from ``source``. An ``OutputsReader`` maps them (no copy; ``release``
        drops them from memory once used) or, where it cannot map, reads into one buffer per side and name,
        allocated at the first (largest) chunk and reused for every other."""
        key = (id(source), name, start, stop)
        if key not in self.read_here:
            out = self._read(source, side, name, start, stop)
            real = self.positions.get(name)
            self.read_here[key] = out if real is None else mask_padding(out, real[start:stop])
        return self.read_here[key]

    def _read(self, source: Source, side: str, name: str, start: int, stop: int) -> torch.Tensor:
        if not isinstance(source, OutputsReader):
            return source.read(name, start, stop).to(self.device)
        view = source.view(name, start, stop)
        if view is not None:
            self.mapped.append((source, name, start, stop))
            return view.to(self.device)
        out = source.read(name, start, stop, self.buffers.get((side, name)))
        if (side, name) not in self.buffers:
            self.buffers[(side, name)] = out
        return out.to(self.device)

    def release(self) -> None:
        """Drop the chunk's tensors, and its mapped pages from resident memory."""
        self.read_here.clear()
        for source, name, start, stop in self.mapped:
            source.release(name, start, stop)
        self.mapped.clear()

    def quantile_merged(self) -> bool:
        """Whether a quantile buffer merged since the last call (its freed memory is worth giving back)."""
        now = sum(g.p_abs.merges + g.p_rel.merges for g in self.gaps.values())
        now += sum(q.merges for q in self.decisions.kl_quantiles.values()) if self.decisions else 0
        changed, self.merges = now != self.merges, now
        return changed


def _chunk(st: _State, ref: Source, trial: Source, trained: Source, fp64: Source | None, start: int, stop: int) -> None:
    """Rows start:stop of every source read once, their statistics computed by slices (small temporaries)."""
    chunk = {name: (st.read(ref, "reference", name, start, stop), st.read(trial, "trial", name, start, stop))
             for name in st.names}
    covered = min(fp64.rows, stop) if fp64 is not None else start  # the FP64 re-run holds the fixed set's first cases
    chunk_fp64 = {name: st.read(fp64, "fp64", name, start, covered) for name in st.names} if covered > start else None
    chunk_trained = {name: st.read(trained, "trained", name, start, stop) for name in st.names}
    trained_main = chunk_trained[st.main]
    trained_finite = {name: _note_nonfinite(st, "trained", name, start, out,  # every output of the AMP-trained model
                                            _valid_positions(st, name, out.shape, start, stop))  # (the trial's: below)
                      for name, out in chunk_trained.items()}
    for name in st.names:
        r_all, t_all = chunk[name]
        main = name == st.main
        for a, b, p, q in _slices(r_all.shape, start, st.per_token and main, st.slice_elements):
            r, t = r_all[a - start : b - start], t_all[a - start : b - start]
            if p is not None:
                r, t = r[:, p:q], t[:, p:q]
            runs = _runs(st.kinds, a, b)
            before, nonfinite_before = st.gaps[name].failing_so_far(), st.gaps[name].nonfinite_so_far()
            same = r.dtype == t.dtype and r.dtype in (torch.float32, torch.float64)
            fused = st.decisions is not None and bool(st.decisions.kernels)  # (the kernels need no difference)
            diff = torch.sub(t, r) if main and st.per_token and same and not fused else None  # the gap's and KL's, once
            valid = _valid_positions(st, name, r.shape, a, b, p, q)  # None: every position counts
            parts = [(st.gaps[name].update(_kept(r, x - a, y - a, valid), _kept(t, x - a, y - a, valid), k,
                                           _kept(diff, x - a, y - a, valid)), st.gaps[name].last_finite) for x, y, k in runs]
            worst = parts[0][0] if len(parts) == 1 else torch.cat([g for g, _ in parts])  # each row's largest gap
            finite = all(f for _, f in parts) and valid is None  # masked: the ignored positions' finiteness is unknown
            if st.gaps[name].nonfinite_so_far() > nonfinite_before:  # rare: which rows, for the rollback's cases
                _note_nonfinite(st, "trial", name, a, t, valid)
            if st.gaps[name].failing_so_far() > before:  # rare: which rows failed, for the rollback's cases
                rows = st.failing_rows.setdefault(name, torch.zeros(len(st.kinds), dtype=torch.bool))
                failing = st.gaps[name].failing_rows(_kept(r, 0, b - a, valid), _kept(t, 0, b - a, valid))
                rows[a:b] |= _per_row(failing, valid, b - a, False).cpu()
            if worst.numel():
                st.row_gap[a:b] = torch.maximum(st.row_gap[a:b], _per_row(worst, valid, b - a, 0.0).cpu())
            if chunk_fp64 is not None and a < covered:
                k = min(b, covered) - a
                f = chunk_fp64[name][a - start : a - start + k]
                f = f[:, p:q] if p is not None else f
                st.arbiter[name].update(*(v[:k] if valid is None else v[:k][valid[:k]] for v in (r, t, f)))
            if name in st.signs:
                r_side, t_side, rows_of, positions_of = st.signs[name]
                r_side.append(_kept(r, 0, b - a, valid).detach().reshape(-1).double().cpu())
                t_side.append(_kept(t, 0, b - a, valid).detach().reshape(-1).double().cpu())
                if r.ndim == 3 or r.ndim == 2 and r.shape[-1] > 1:  # per token, or per label [N, L]: case and position
                    where = torch.nonzero(valid if valid is not None else torch.ones(r.shape[:2], dtype=torch.bool)).cpu()
                    rows_of.append(where[:, 0] + a)
                    positions_of.append(where[:, 1])
            if name in st.heads and p is None:
                st.heads[name].update(a, r, t, None if valid is None or main else _ignored_where(valid),
                                      exact=stored_rows(ref, name, st.heads[name].margin_kind, a, b))
            if not main:
                continue
            y = st.targets[a:b] if not st.per_token else st.targets[a:b, p:q]
            judged = st.judged[name][a:b] if st.judged[name] is not None else None  # (``valid``: None where all are)
            labelled = labelled_positions(tuple(r.shape), y, judged) if st.kind != "classification" else None
            if st.threshold is not None:
                for side, value in zip(("reference", "trial", "label"), _threshold_pick(r, t, st.threshold,
                                                                                         valid if labelled is None else labelled,
                                                                                         st.ties)):
                    st.crossing[side].append(value)
            labels = None
            if st.decisions is not None:
                labels = st.decisions.update(a, r, t, y if st.per_token else None, position=p or 0, diff=diff,
                                             exact=stored_rows(ref, name, st.decisions.margin_kind, a, b, p, q),
                                             stored_kl=stored_kl(trial, name, a, b, p, q))
            trained_slice = trained_main[a - start : b - start]
            trained_slice = trained_slice[:, p:q] if p is not None else trained_slice
            with_target = st.has_target[a:b]
            every, some = bool(with_target.all()), bool(with_target.any())
            ref_hits = None
            for side, out, fin in zip(SIDES, (r, t, trained_slice), (finite, finite, trained_finite[name])):
                known, lse = labels.of(side) if labels is not None else (None, None)
                if side == "trained" and fused and st.per_token and out.dtype == torch.float32 and out.device.type == "cpu":
                    known, lse = labels_and_lse(out, st.decisions.tie_rule)  # (None: torch's path)
                hits = None
                if labelled is not None:  # a regression per position: its kept, labelled positions, padded or not
                    keep = labelled & with_target[:, None]
                    if bool(keep.any()):
                        hits = st.quality[side].update(out[keep], y[keep], finite=False)
                elif every:  # no copy of the slice
                    hits = st.quality[side].update(out, y, known, lse, finite=fin)
                elif some:
                    hits = st.quality[side].update(out[with_target], y[with_target],
                                                   known[with_target] if known is not None else None,
                                                   lse[with_target] if lse is not None else None, finite=fin)
                if side == "reference":
                    ref_hits = hits
                elif hits is not None and ref_hits is not None:
                    pair = st.paired.setdefault(side, [0, 0])
                    pair[0] += int((ref_hits & ~hits).sum())
                    pair[1] += int((~ref_hits & hits).sum())
                if st.kind != "classification":
                    st.first_values[side].append(out.reshape(out.shape[0], -1)[:, :1].double().reshape(-1).cpu())
            if st.quantile_merged():
                _give_back_freed_memory()


def position_heads(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str, targets: torch.Tensor,
                   has_target: torch.Tensor, token_mask: torch.Tensor | None,
                   names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The argmax heads read over the batch's positions (``heads.position_names``), each with its real positions [N, T]
    (``task.scores_over_positions``, on the whole set's ``shapes``), or {} where the primary's targets index none;
    ``names``: those recorded by freeze (``heads.Roles``), else inferred.
    Everything compare and freeze compute of them (decisions, gaps, finiteness, quality) reads their padding at -inf
    (``task.mask_padding``)."""
    names = heads.position_names(kind, rule, shapes, main) if names is None else names
    real = scores_over_positions(shapes[main], targets, has_target, token_mask) if names else None
    return {} if real is None else dict.fromkeys(names, real)


def _threshold_pick(r: torch.Tensor, t: torch.Tensor, threshold: float, valid: torch.Tensor | None, ties: bool = False):
    """Per case, the reference and trial values judged against a regression's threshold: the first of its values (at
    a kept position) that crosses it between the two, else the reference's first value on both sides; a case flips
    where any value does (a multi-label head of logits with threshold 0, per label); and that value's index (its label)."""
    rows = r.shape[0]
    keep = None if valid is None else valid.reshape(*valid.shape, *[1] * (r.ndim - valid.ndim)).expand(r.shape)
    r2, t2 = r.reshape(rows, -1), t.reshape(rows, -1)
    crossed, at = first_crossing(r2, t2, threshold, None if keep is None else keep.reshape(rows, -1), ties)
    r_pick, t_pick = (v.gather(1, at)[:, 0].double().cpu() for v in (r2, t2))
    return r_pick, torch.where(crossed.cpu(), t_pick, r_pick), at[:, 0].cpu()  # no crossing: no flip, padding at 0 or not


def _sign_result(ids: Sequence[str], kinds: Sequence[str], name: str, shape: tuple[int, ...], sides: tuple[list, ...],
                 rule: AcceptanceConfig, cfg: CompareConfig) -> Decisions:
    """``sign_flips`` of one head of role labels from what ``_chunk`` kept of it (per token: each kept position; a
    multi-label head [N, L]: each label, its index as the position); at its stated threshold, else a probability at 0.5
    (``holds_probabilities``), a logit at 0."""
    r, t, rows, positions = sides
    r, t = torch.cat(r), torch.cat(t)
    stated = rule.tolerance(name).threshold
    probability = stated is None and holds_probabilities(name, r)
    at = 0.0 if stated is None else stated
    if len(shape) != 3 and math.prod(shape[1:]) == 1:
        return sign_flips(ids, kinds, r, t, rule.boundary_margin, rule.boundary_margin_kind, cfg.max_listed_flips,
                          probability=probability, tie_rule=rule.tie_rule, at=at)
    rows = torch.cat(rows).tolist() if rows else []
    return sign_flips([ids[i] for i in rows], [kinds[i] for i in rows], r, t, rule.boundary_margin, rule.boundary_margin_kind,
                      cfg.max_listed_flips, torch.cat(positions).tolist() if positions else [], probability=probability,
                      tie_rule=rule.tie_rule, at=at)


def nonfinite_summary(ids: Sequence[str], kinds: Sequence[str], rows: torch.Tensor, elements: dict[str, int],
                      listed: int = 1000) -> NonFinite:
    """Rows with a non-finite output (any head), by kind, with their ids (the first ``listed``)."""
    where = torch.nonzero(rows).flatten().tolist()
    by_kind: dict[str, int] = {}
    for i in where:
        by_kind[kinds[i]] = by_kind.get(kinds[i], 0) + 1
    return NonFinite(rows=len(where), per_kind=dict(sorted(by_kind.items())), ids=tuple(ids[i] for i in where[:listed]),
                     elements={k: v for k, v in sorted(elements.items()) if v})


def _valid_positions(st: _State, name: str, shape: tuple[int, ...], a: int, b: int, p: int | None = None,
                     q: int | None = None) -> torch.Tensor | None:
    """The positions [b - a, q - p] of per-token output ``name`` (``shape``: [rows, T, ...]) that count, rows a:b
    (``task.judged_positions``: the token mask's, else the primary's targets'); None when all of them count."""
    keep = st.judged.get(name)
    if keep is None or len(shape) not in (2, 3):  # per token [N, T, ...], or a value per position [N, T]
        return None
    keep = keep[a:b, p:q] if p is not None else keep[a:b]
    return None if bool(keep.all()) else keep


def _to(v: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if v is None else v.to(device)


def _kept(v: torch.Tensor | None, x: int, y: int, valid: torch.Tensor | None) -> torch.Tensor | None:
    """Rows x:y of ``v``; only their kept positions (``valid``, [rows, T]: then [kept, ...]) when some are ignored."""
    if v is None:
        return None
    return v[x:y] if valid is None else v[x:y][valid[x:y]]


def _per_row(per_position: torch.Tensor, valid: torch.Tensor | None, rows: int, empty) -> torch.Tensor:
    """Per row, the largest (or, boolean, any) of the values of its kept positions ``valid`` (given row-major: the
    order of ``t[valid]``); ``per_position`` itself, per row already, when ``valid`` is None."""
    if valid is None:
        return per_position
    row_of = torch.nonzero(valid)[:, 0]
    if per_position.dtype == torch.bool:
        out = torch.zeros(rows, dtype=torch.bool, device=per_position.device)
        out[row_of[per_position]] = True
        return out
    out = torch.full((rows,), empty, dtype=per_position.dtype, device=per_position.device)
    return out.scatter_reduce_(0, row_of, per_position, reduce="amax", include_self=True)


def _ignored_where(valid: torch.Tensor) -> torch.Tensor:
    """Per-position targets that only say which positions are ignored (-100 where ``valid`` is False)."""
    return torch.where(valid, 0, IGNORE_INDEX)


def _note_nonfinite(st: _State, side: str, name: str, row: int, out: torch.Tensor, valid: torch.Tensor | None = None) -> bool:
    """Rows (from ``row``) of ``out`` with a non-finite element (``broken_where_judged``), into the side's tally,
    whatever the head; whether every element was finite. ``valid``: the positions of a per-token output that count."""
    bad = broken_where_judged(out, valid, st.gaps[name].softmax)
    if bad is None:
        return True
    st.nonfinite[side][row : row + out.shape[0]] |= bad.reshape(out.shape[0], -1).any(1).cpu()
    st.nonfinite_elements[side][name] += int(bad.sum())
    return False


def broken_where_judged(out: torch.Tensor, valid: torch.Tensor | None, softmax: bool) -> torch.Tensor | None:
    """Where an element of ``out`` is not finite as an output (``gaps.broken``: of class scores decided through softmax,
    -inf beside a finite maximum is a masked class, no fault) at the positions ``valid`` keeps (per token [n, T]; None:
    all); None when every element of ``out`` is finite (the common case: one sum)."""
    if not out.numel() or all_finite(out):
        return None
    if valid is not None:
        keep = valid.reshape(*valid.shape, *[1] * (out.ndim - valid.ndim))  # [n, T] over [n, T, ...] or [n, T]
        out = torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return broken(out, softmax)


def nonfinite_rows(kind: str, rule: AcceptanceConfig, chunk: dict[str, torch.Tensor], row: int, targets: torch.Tensor,
                   token_mask: torch.Tensor | None, positions: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows of ``chunk`` (every output of the fixed set's rows from ``row`` on) with an element not finite where compare
    judges it (``broken_where_judged``, at ``task.judged_positions``, scores over positions without their padding:
    ``positions``, the whole set's ``position_heads``; ``targets`` and ``token_mask`` the whole set's): what freeze
    refuses in the reference."""
    chunk = {name: chunk[name] for name in heads.judged(rule, chunk)}
    shapes = {name: tuple(v.shape) for name, v in chunk.items()}
    main = primary_name(shapes)
    positions = positions or {}
    chunk = {name: mask_padding(v, positions[name][row : row + v.shape[0]]) if name in positions else v
             for name, v in chunk.items()}
    argmax = decided_heads(kind, rule, shapes, main)
    per_token = kind == "classification" and len(shapes[main]) == 3
    n = shapes[main][0]
    out = torch.zeros(n, dtype=torch.bool)
    for name, v in chunk.items():
        keep = judged_positions((len(targets), *shapes[name][1:]), per_token and name == main, targets, token_mask,
                                primary=name == main)  # the whole set's shape: a chunk has fewer rows
        bad = broken_where_judged(v, None if keep is None else keep[row : row + n].to(v.device), name in argmax)
        if bad is not None:
            out |= bad.reshape(n, -1).any(1).cpu()
    return out


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
KEEP_FREED_BYTES = 32 << 20
"""Within a chunk, freed heap up to this much stays with the process, and allocations up to this much come from the
heap (``_keep_freed_memory``)."""


@functools.lru_cache(maxsize=1)
def _keep_freed_memory() -> None:
    """Let a slice's temporaries (about 1 MiB each, freed and allocated again slice after slice) reuse the heap's
    pages: by default glibc maps an allocation of that size on its own and unmaps it when freed, or trims the heap's
    top once 2 of them are free, so that every slice touched fresh pages (a page fault every 4 KiB: a fifth of
    compare's time on one thread, ``scripts/bench_compare.py``). ``_give_back_freed_memory`` still trims the heap
    after each chunk, so resident memory stays one chunk. Process-wide, set once: it changes where memory comes from,
    never what is computed."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)


def _give_back_freed_memory() -> None:
    """Return the heap freed by a chunk's temporaries to the OS (glibc keeps it otherwise, and the
    resident memory of a long comparison would grow with fragmentation, not with the chunk)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.malloc_trim  # glibc only
        return lib
    except (OSError, AttributeError):
        return None


SLICE_ELEMENTS = 1 << 18
"""Elements per computation slice: each temporary of the statistics is about 1 MiB (cache-resident), whatever the chunk."""

KERNEL_SLICE_ELEMENTS = 1 << 20
"""Elements per slice where the C kernels compute the statistics (``native``): they keep no temporary of a slice's
size, so a larger slice only cuts the per-slice work of Python (measured on one CPU thread: 1.4x compare's speed
per token at 2^20 against 2^18, no more at 2^22)."""


def _slices(shape: tuple[int, ...], start: int, by_position: bool, limit: int = SLICE_ELEMENTS):
    """(row_a, row_b, position_p, position_q) slices of at most about ``limit`` elements of a chunk whose first
    row is ``start``; positions are None unless ``by_position`` (per-token scores [n, T, C]) and one row exceeds it."""
    rows = shape[0]
    per_row = max(math.prod(shape[1:]), 1)
    if by_position and per_row > limit and len(shape) == 3:
        per_pos = max(math.prod(shape[2:]), 1)
        width = rows_within(limit, per_pos)
        for i in range(rows):
            for p in range(0, shape[1], width):
                yield start + i, start + i + 1, p, min(p + width, shape[1])
        return
    height = rows_within(limit, per_row)
    for i in range(0, rows, height):
        yield start + i, start + min(i + height, rows), None, None


def training_stats(rule: AcceptanceConfig, runs: Trajectories) -> Training:
    """The trial's trajectory against the reference's; against ``runs.aligned`` instead when given, so that
    designed skips are not judged as precision. The noise floor is the replicate against the reference it
    repeats, never against the aligned run (whose gap to the reference is the skips'). The reference's own losses
    must be finite at every step too."""
    base = runs.aligned if runs.aligned is not None else runs.reference
    ref_loss = [s.loss for s in base]
    trial_loss = [s.loss for s in runs.trial]
    reference = [s.loss for s in runs.reference]
    copies = [r for r in (runs.replicate, *runs.more_replicates) if r is not None]  # the FP32 replicates, first first
    replicates = [[s.loss for s in r] for r in copies]
    replicate, more = (replicates[0], replicates[1:]) if replicates else (None, [])
    # A step whose forward overflowed (loss not finite) and whose update the GradScaler skipped is an incident the
    # scaler handled: not measured by the band; its frequency is (the skip limits), and what follows is.
    excused = [runs.scaler_enabled and s.skipped and not math.isfinite(s.loss) for s in runs.trial]
    gap = trajectory_gap(ref_loss, trial_loss, rule.loss_atol, rule.loss_rtol, replicate, rule.loss_noise_multiple,
                         rule.loss_noise_atol, replicate_of=reference, excused=excused, more_replicates=more)
    skipped = [s.skipped for s in runs.trial]
    # The opening skips are excused where the rule judges quality after training: what the updates lost cost shows
    # there. Without, nothing would (the band holds the trial against FP32 aligned on the same skips): they count.
    overflowed = [not math.isfinite(v) for v in trial_loss]
    calibration = calibration_steps(skipped, overflowed) if runs.scaler_enabled and rule.judges_quality else 0
    health = update_health(
        skipped,
        [s.scale for s in runs.trial] + [runs.final_scale],
        [not math.isfinite(v) and not spared for v, spared in zip(trial_loss, excused)],
        rule.stall_window,
        [s.nonfinite_grad for s in runs.trial],
        calibration,
    )
    first_bad_reference = next((i for i, s in enumerate(runs.reference) if not math.isfinite(s.loss)), -1)
    final = final_loss(trial_loss, [reference, *replicates]) if replicates else None  # FP32's spread needs a replicate
    # Time to quality (benchmark): against the reference itself, never the skip-aligned run (the target is FP32's end).
    reach = updates_to_fp32_loss((trial_loss, skipped), (reference, [s.skipped for s in runs.reference]),
                                 [(losses, [s.skipped for s in r]) for losses, r in zip(replicates, copies)])
    return Training.of(gap, health, scaler_enabled=runs.scaler_enabled, aligned_on_skips=runs.aligned is not None,
                       first_nonfinite_reference_step=first_bad_reference, final=final, updates_to_fp32_loss=reach)


def case_table_rows(ids: list[str], kinds: list[str], flips: Decisions, row_gap: torch.Tensor, per_case: PerCase | None,
                    firsts: tuple[torch.Tensor, torch.Tensor] | None, worst: int) -> list[dict]:
    """Every flipped case and the ``worst`` others with the largest gap (per token: largest KL), in case order.

    ``per_case``: the classification's numbers per case; ``firsts``: the regression's first output per case
    (reference, trial). The rows are ``cases.json``'s."""
    n = len(ids)
    if n == 0:
        return []
    per_token = per_case is not None and flips.unit == "token"
    if per_case is not None:
        flipped = per_case.flips
    else:
        flipped_ids = {f.id for f in flips.flip_list}
        flipped = torch.tensor([i in flipped_ids for i in ids], dtype=torch.int32)
    score = per_case.kl_max.double() if per_token else row_gap.double()
    keep = flipped > 0
    others = (~keep).nonzero().flatten()
    if worst and others.numel():
        # ties: lowest index first
        order = torch.sort(torch.nan_to_num(score[others], nan=math.inf), descending=True, stable=True).indices
        keep[others[order[:worst]]] = True
    kl_mean = per_case.kl_mean if per_token else None
    rows = []
    for i in keep.nonzero().flatten().tolist():
        row = {"id": ids[i], "kind": kinds[i], "max_abs_gap": float(row_gap[i]), "flipped": bool(flipped[i] > 0)}
        if per_token:
            row.update({"flipped_tokens": int(flipped[i]), "kl_mean": float(kl_mean[i]), "kl_max": float(per_case.kl_max[i]),
                        "worst_token": int(per_case.worst_token[i]), "reference_margin": float(per_case.margin[i])})
        elif per_case is not None:
            row.update({"reference_class": int(per_case.reference_class[i]), "trial_class": int(per_case.trial_class[i]),
                        "reference_margin": float(per_case.margin[i])})
        elif firsts is not None:
            row.update({"reference": float(firsts[0][i]), "trial": float(firsts[1][i])})
        rows.append(row)
    return rows
