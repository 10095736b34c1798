"""The acceptance rule vetted against the FP32 reference at freeze, before any trial.

freeze hands a ``Scan`` to ``reference.write``: it sees the outputs as they stream to disk (names, shapes,
RMS per output, the reference's quality with compare's metric) and, with the trajectory, asks
``refusals.problem`` whether the rule can judge trials of this reference at all. A refusal is one line and
leaves the previous reference in place. Only freeze imports this module (trial and compare do not pay for it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipeline import cases, task

from pipeline import refusals

from pipeline.compare import streams
from pipeline.compare.decisions import holds_probabilities, probability_rows
from pipeline.compare.gaps import zero_probability
from pipeline.compare.quality import COLUMNS
from pipeline import heads
from pipeline.config import Params
from pipeline.heads import decided_heads, primary_name, sign_heads

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import FP32Spread
    from pipeline.artifacts.steps import StepRecord


SLICE_ELEMENTS = 4_000_000
"""Elements squared in float64 at once (32 MB): a chunk of an LM's scores, [256, 64, 32000], would need 8 GB."""


class Scan:
    """What the rule is vetted against at freeze, gathered while the outputs stream to disk: each output's
    name, shape and RMS, and the reference's quality on the fixed set (the metric compare uses)."""

    def __init__(self, params: Params, fixed: cases.Cases) -> None:
        self.rule, self.kind, self.loss = params.acceptance, params.task.kind, params.task.loss
        self.per_label: list[str] = []
        """Outputs decided by argmax that have the shape of a primary decided label by label at a threshold (a multi-label
        head's logits beside its sigmoid's ``probs``): argmax across independent labels is no decision."""
        self.fitted: list[int] | None = None
        """A regression's primary that ``loss: model`` with one value reads as fitted to labels 0 or 1, decided at 0.5
        (``TaskConfig.fits_values``: Hugging Face's regression head): [its values outside [-0.5, 1.5], its values, its labels
        right when read at 0.5, right when read at 0, its labels], at the positions compare judges. Many outside, or many
        more right at 0, are a sigmoid's logits (a model's own BCE, ``problem_type`` multi-label), decided at 0."""
        self.metric = streams.Metric.for_task(params.task)
        self.quality = self.metric.quality(params.acceptance.tie_rule)
        """The reference's quality, in the metric compare reads the primary by (``streams.Metric.reading``: set at the
        first chunk, where the primary is known)."""
        self.targets = task.masked_targets(fixed.y, task.token_mask_of(fixed.x))
        self.has_target = fixed.has_target.bool()
        kinds = streams.kinds_of(fixed.ids)
        ordinary = torch.tensor([k == "ordinary" for k in kinds], dtype=torch.bool)
        self.drawn = ordinary
        """The ordinary cases: the draws of the data a flip rate is bounded on (``real_units``)."""
        self.constructed = torch.tensor([k == "boundary" for k in kinds], dtype=torch.bool)
        """The constructed boundary cases, whose flips the rule may allow (``max_boundary_flip_fraction``): a head's
        decision varying there alone would catch no trial (``decided``)."""
        self.ordinary = ordinary if bool(ordinary.any()) and not bool(ordinary.all()) else None
        """The ordinary cases, when the set has others too: an output's scale is its scale there as well as over the
        whole set (edge cases of inputs x100 would otherwise set it for an application whose outputs are 10x smaller)."""
        self.distributions: dict[str, bool] = {}
        """Per output of a regression task other than its primary, shaped like class scores and not said decided or not
        by its name or entry (``_undecided``): whether every row of the reference is a probability distribution."""
        self.masked: dict[str, float] = {}
        """Per such output (``_undecided``) whose reference holds masking values (``masking_value``): the lowest."""
        self.softmaxed: dict[str, bool] = {}
        """Per decided output (class scores): whether every row of the reference so far is a probability distribution."""
        self.unit: dict[str, list] = {}
        """Per decided single-value head whose name does not say logit (it says neither, ``_guessed``, or probability):
        [smallest, largest finite reference value, whether one lies strictly between 0 and 1], at the positions compare
        keeps."""
        self.token_mask = task.token_mask_of(fixed.x)
        self.positions: dict[str, torch.Tensor] | None = None
        """Per output read as scores over positions (``streams.position_heads``): its real positions, padding read at -inf
        (None until the first chunk: ``_position_heads``)."""
        self.lengths, self.channels = _positions(fixed.x)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.every_shape: dict[str, tuple[int, ...]] = {}
        """Every output's shape over the whole set, those stated ``ignored`` too (``roles``)."""
        self.threshold: float | None = None
        """The primary's decision threshold, as compare reads it (``streams.Metric.reading``)."""
        self.squares: dict[str, list] = {}
        """Per output: [sum of squares, count] over the whole set, then over the ordinary cases (``ordinary``)."""
        self.whole: dict[str, float] = {}
        """Per output whose every finite reference value is a whole number (a class index, a bin, a count, a rounded
        value: its unit is 1): the largest magnitude among them (``whole_numbers``)."""
        self.moments: dict[str, list] = {}
        """Per output judged by its values alone, of at most ``COLUMNS`` columns (one for [N], [N, 1] or a value per
        position [N, T]: ``_values_of``), per column, at the positions compare judges (a sequence's padding is no value):
        [sums, sums of squares, rows] over the whole set, then over the ordinary cases. Columns of different
        scales share one atol, which must bound the smallest too (``column_rms``), and the band at a column's mean
        must be below its spread (``spreads``)."""
        self.replicas: list = []
        """Each FP32 replicate's quality after training (``update_replicate``): a ``QualityStats`` each, once seen."""
        self.measured: set[str] = set()
        """The outputs of ``moments`` that are a classifier's heads decided by default (``_measured``)."""
        self.decided: dict[str, list] = {}
        """Per output of ``measured``, the reference's decisions over the real cases (not ``constructed``), at the
        positions compare judges: for class scores (argmax), the classes chosen (-1: a tie under ``tie_is_flip``); for a
        single value (its sign, or 0.5 for a probability), [smallest, largest finite value] (``pinned``)."""

    def update(self, row: int, chunk: dict[str, torch.Tensor]) -> None:
        """The chunk's rows from ``row`` on, a slice of rows at a time (``SLICE_ELEMENTS``): an LM's chunk holds GBs
        of scores, and its float64 squares or its rows with a target copied whole would hold as many again."""
        if not self.every_shape:
            self.every_shape = {n: (len(self.has_target), *v.shape[1:]) for n, v in chunk.items()}
        chunk = {n: chunk[n] for n in heads.judged(self.rule, chunk)}  # (role ignored: not judged, not vetted)
        main = primary_name(chunk)
        positions = self._position_heads(chunk)
        chunk = {n: task.mask_padding(v, positions[n][row : row + v.shape[0]]) if n in positions else v
                 for n, v in chunk.items()}  # as compare reads them
        if not self.shapes:
            self._first_chunk(main, chunk)
        shapes = {n: tuple(t.shape) for n, t in chunk.items()}
        scores = set(decided_heads(self.kind, self.rule, shapes, main))
        signs = set(sign_heads(self.kind, self.rule, shapes, main))
        for name, v in chunk.items():
            self._note_output(name, v, row, main, chunk[main].ndim == 3, name in scores, name in signs)

    def _first_chunk(self, main: str, chunk: dict[str, torch.Tensor]) -> None:
        """At the first chunk the primary is known, and how compare reads it: its threshold and metric, whether it may be
        a value fitted to labels (``fitted``), and the heads decided by argmax beside labels decided one by one."""
        out = chunk[main]
        threshold, self.metric = self.metric.reading(self.kind, self.rule, main, tuple(out.shape), self.targets,
                                                     self.has_target)
        self.threshold = threshold
        self.quality = self.metric.quality(self.rule.tie_rule)
        if threshold == 0.5 and self.loss == "model" and self.rule.threshold is None and not heads.says_probability(main):
            self.fitted = [0, 0, 0, 0, 0]
        if threshold is not None and out.ndim in (2, 3) and out.shape[-1] >= 2:  # decided label by label
            shapes = {n: tuple(t.shape) for n, t in chunk.items()}
            self.per_label = [n for n in decided_heads(self.kind, self.rule, shapes, main) if shapes[n] == shapes[main]]

    def _note_output(self, name: str, v: torch.Tensor, row: int, main: str, per_token: bool, scores: bool,
                     signs: bool) -> None:
        """What the scan keeps of output ``name``'s rows from ``row`` on: its shape and questions, then slice by slice."""
        primary = name == main
        self.shapes[name] = tuple(v.shape[1:])
        rows = task.rows_within(SLICE_ELEMENTS, math.prod(v.shape[1:]))
        judged = task.judged_positions((len(self.has_target), *v.shape[1:]),  # the whole set's: a chunk's rows are fewer
                                       self.kind == "classification" and primary and per_token,
                                       self.targets, self.token_mask, primary=primary)
        width = self._values_of(name, v, primary, judged is not None)
        if width and self._measured(name, primary):
            self.measured.add(name)
        if self._undecided(name, v, primary):
            if self.distributions.get(name, True):
                self.distributions[name] = probability_rows(v)
            lowest = masking_value(v)
            if lowest is not None:
                self.masked[name] = min(lowest, self.masked.get(name, lowest))
        if signs and not heads.says_logit(name):  # named neither, or like a probability
            self._note_unit(name, v, row)
        if scores and self.softmaxed.get(name, True):
            self.softmaxed[name] = probability_rows(v)
        for a in range(0, v.shape[0], rows):
            b = min(a + rows, v.shape[0])
            self._note_slice(name, v[a:b], row + a, None if judged is None else judged[row + a : row + b], width, scores,
                             primary)

    def _note_slice(self, name: str, v: torch.Tensor, row: int, positions: torch.Tensor | None, width: int, scores: bool,
                    primary: bool) -> None:
        """One slice of rows (from ``row``) of output ``name``: its whole numbers, scale, moments, decisions and, for the
        primary, the quality and how its values read against labels (``fitted``)."""
        values = v.detach().double()
        kept = [values if positions is None else values[positions]]  # where compare judges values
        scaled = [_scaled(values, positions, scores)]
        if self.ordinary is not None:
            ordinary = self.ordinary[row : row + v.shape[0]]
            kept.append(values[ordinary] if positions is None else values[ordinary][positions[ordinary]])
            scaled.append(scaled[0][ordinary])
        if name in self.measured:
            real = ~self.constructed[row : row + v.shape[0]]
            self._note_decisions(name, values[real] if positions is None else values[real][positions[real]])
        if self.whole.get(name, 0.0) is not None:  # decided heads too: bins or votes decided by argmax
            finite = values[torch.isfinite(values)]
            small = finite[finite.abs() < task.FLOAT32_EXACT_WHOLE]  # from 2**24 on, every float32 is whole: no sign
            if not bool((small == small.round()).all()):
                self.whole[name] = None  # not whole numbers: the rest of the output is not looked at
            elif small.numel():
                self.whole[name] = max(self.whole.get(name, 0.0), float(finite.abs().max()))
        if primary and self.fitted is not None:
            finite = kept[0][torch.isfinite(kept[0])]
            self.fitted[0] += int(((finite < -0.5) | (finite > 1.5)).sum())
            self.fitted[1] += finite.numel()
        for i, part in enumerate(kept):
            total = self.squares.setdefault(name, [[0.0, 0], [0.0, 0]])[i]
            counted = scaled[i].square()
            total[0], total[1] = total[0] + float(counted.nansum()), total[1] + int((~torch.isnan(counted)).sum())
            if width:
                m = self.moments.setdefault(name, [[0.0, 0.0, 0], [0.0, 0.0, 0]])[i]
                m[0] = m[0] + part.reshape(-1, width).sum(0)
                m[1] = m[1] + part.square().reshape(-1, width).sum(0)
                m[2] += part.numel() // width
        if primary:
            self._note_quality(v, row, positions)

    def _note_quality(self, out: torch.Tensor, row: int, positions: torch.Tensor | None) -> None:
        """The primary's rows (from ``row``) scored where compare scores them, and read at 0.5 and at 0 (``logit_like``)."""
        picked = self._scored(out, row, positions)
        if picked is None:
            return
        scored, known = picked
        self.quality.update(scored, known)
        if self.fitted is not None:
            o, known = scored.reshape(-1), known.reshape(-1)
            if o.numel() == known.numel():
                o, positive = o[known != task.IGNORE_INDEX], known[known != task.IGNORE_INDEX] >= 0.5
                self.fitted[2] += int(((o >= 0.5) == positive).sum())
                self.fitted[3] += int(((o >= 0) == positive).sum())
                self.fitted[4] += o.numel()

    def _scored(self, out: torch.Tensor, row: int, positions: torch.Tensor | None):
        """The primary's rows ``out`` (from ``row``) and their targets where compare scores quality (the cases with a
        target; a regression per position: its labelled positions), or None where none is."""
        if self.kind == "classification" and out.shape[1:-1] != self.targets.shape[1:]:
            return None  # refused (``refusals.problem``: no decision check reads it)
        keep = self.has_target[row : row + out.shape[0]]
        y = self.targets[row : row + out.shape[0]]
        labelled = task.labelled_positions(tuple(out.shape), y, positions) if self.kind != "classification" else None
        if labelled is not None:  # a regression per position: compare's quality, at its labelled positions
            keep = labelled & keep[:, None]
        return (out[keep], y[keep]) if bool(keep.any()) else None

    def update_replicate(self, index: int, row: int, chunk: dict[str, torch.Tensor]) -> None:
        """The ``index``-th FP32 replicate's outputs (from ``row``), after the reference's have all been seen: its quality
        after training, in the metric and reading the reference's set (``replicate_quality``)."""
        while len(self.replicas) <= index:
            self.replicas.append(self.metric.quality(self.rule.tie_rule))
        chunk = {n: chunk[n] for n in heads.judged(self.rule, chunk)}
        main = primary_name(chunk)
        positions = self._position_heads(chunk)
        out = chunk[main]
        if main in positions:
            out = task.mask_padding(out, positions[main][row : row + out.shape[0]])
        judged = task.judged_positions((len(self.has_target), *out.shape[1:]),
                                       self.kind == "classification" and out.ndim == 3, self.targets, self.token_mask,
                                       primary=True)
        picked = self._scored(out.detach(), row, None if judged is None else judged[row : row + out.shape[0]])
        if picked is not None:
            self.replicas[index].update(*picked)

    def replicate_quality(self) -> tuple[float, list[float]] | None:
        """(reference, [each replicate]) quality on the fixed set, as the scan measured them, or None without a replicate
        (``update_replicate``) or where one is not finite: FP32's own spread after training."""
        if not self.replicas:
            return None
        ref, reps = self.quality.result(), [q.result() for q in self.replicas]
        return (ref, reps) if all(math.isfinite(v) for v in (ref, *reps)) else None

    def _values_of(self, name: str, v: torch.Tensor, primary: bool, per_position: bool) -> int:
        """The columns of output ``name`` (its last axis: [N, D] or per token [N, T, D]; one for [N], and for a value
        per position [N, T]: ``per_position``, ``task.judged_positions``) when it holds values that atol and rtol bound,
        at most ``COLUMNS`` of them, else 0: a regression's outputs, and a classifier's said ``decisions: false``; not the
        decided heads, whose class scores share one scale, nor a classifier's features (an embedding's dimensions are
        no quantities of their own: ``heads.says_features``)."""
        width = v.shape[-1] if v.ndim >= 3 or v.ndim == 2 and not per_position else 1
        if width > COLUMNS:
            return 0
        tolerance = self.rule.tolerance(name)
        if self.kind == "regression":
            return width if primary or not heads.decides(tolerance, name, self.kind) else 0
        values = not heads.decides(tolerance, name, self.kind) and not heads.says_features(name)
        return width if values or self._measured(name, primary) else 0

    def _measured(self, name: str, primary: bool) -> bool:
        """Whether ``name`` is a classifier's head decided only because nothing names it (``Tolerance.decides``, not
        ``scored``: no score's name, no feature's, nothing said), such as a measurement beside the logits, ``pressure`` [N]
        decided by its sign or ``size`` [N, 3] by argmax: its spread is vetted where an offset makes its band vacuous
        (``spreads``)."""
        tolerance = self.rule.tolerance(name)
        return (self.kind == "classification" and not primary and heads.decides(tolerance, name, self.kind)
                and not heads.scored(tolerance, name, self.kind) and name not in (self.positions or {}))

    def spreads(self) -> dict[str, tuple[tuple[float, float], ...]]:
        """Per output judged by its values alone (``moments``), per column: (mean, standard deviation) over the whole
        set or over the ordinary cases, whichever spreads less (the variation a tolerance at that mean must be below).
        A classifier's heads decided by default (``measured``) are left to ``pinned_offset``: their decisions judge them
        too."""
        return {name: columns for name, columns in self._spreads().items() if name not in self.measured}

    def _spreads(self) -> dict[str, tuple[tuple[float, float], ...]]:
        out = {}
        for name, parts in self.moments.items():
            found = []
            for total, squares, rows in parts:
                if rows:
                    mean = total / rows
                    found.append((mean, (squares / rows - mean.square()).clamp(min=0.0).sqrt()))
            if found:
                out[name] = tuple(min(((float(m[c]), float(sd[c])) for m, sd in found), key=lambda pair: pair[1])
                                  for c in range(found[0][0].numel()))
        return out

    def _note_decisions(self, name: str, values: torch.Tensor) -> None:
        """The reference's decisions of measured head ``name`` in ``values`` (its real cases' rows, at the positions
        compare judges), into ``decided``: argmax over the last axis where compare reads class scores
        (``heads.decided_heads``), the range of a single value (``heads.sign_heads``); nothing for a head compare
        decides no way ([N, a, b, c]: ``pinned`` reads it as pinned)."""
        shape = self.shapes[name]
        if math.prod(shape) == 1 or len(shape) == 2 and shape[-1] == 1:  # [N], [N, 1], per token [N, T, 1]
            finite = values[torch.isfinite(values)]
            if finite.numel():
                lo, hi = self.decided.setdefault(name, [math.inf, -math.inf])
                self.decided[name] = [min(lo, float(finite.min())), max(hi, float(finite.max()))]
        elif len(shape) in (1, 2) and shape[-1] >= 2 and values.numel():  # [N, C], per token [N, T, C]
            scores = values.reshape(-1, shape[-1])
            labels = scores.argmax(-1)  # the first of tied maxima: ``lowest_index``
            if self.rule.tie_rule == "tie_is_flip":
                top = scores.topk(2, -1).values
                labels = labels.masked_fill(top[:, 0] == top[:, 1], -1)
            self.decided.setdefault(name, set()).update(labels.unique().tolist())

    def pinned(self, name: str) -> str | None:
        """How measured head ``name``'s decision is the same for every real case of the reference (``decided``), in
        words, or None where it varies. A single value is decided as compare decides it (``decisions.sign_flips``): at
        0.5 where it holds a probability (``holds_probabilities``: its name says so, or every value lies in [0, 1]), else
        at 0; a value exactly there is a tie of its own under ``tie_is_flip``."""
        seen = self.decided.get(name)
        if seen is None:  # decided no way compare reads, or no real case: nothing but its values judges it
            return "no decision compare reads" if len(self.shapes[name]) >= 3 else "no real case decides it"
        if isinstance(seen, set):
            return f"argmax {'a tie' if -1 in seen else f'column {min(seen)}'} in every case" if len(seen) == 1 else None
        lo, hi = seen
        at = 0.5 if holds_probabilities(name, torch.tensor([lo, hi])) else 0.0
        strict = self.rule.tie_rule == "tie_is_flip"
        if lo > at or lo == at and not strict:
            return f"at or above {at:g} in every case"
        if hi < at:
            return f"below {at:g} in every case"
        return None

    def pinned_offset(self) -> str | None:
        """The refusal of a classifier's head decided by default (``measured``) that nothing can fail, or None.

        One definition: refused where both hold. (a) Its decision is pinned over the fixed set (``pinned``): the same
        argmax, or the same side of its threshold, in every real case. (b) On some column its offset alone makes the band
        vacuous, rtol x |mean| >= standard deviation (101340 Pa +- 30: rtol's band is 2027 Pa). Then a trial answering
        the column's mean for every case passes its values, the band at the mean covering their spread, and its
        decisions, which were never going to change. Each half is needed. Where the decision varies, a trial answering
        the means changes it where the reference's differs and the decision checks roll it back: Q-values V(s) + A(s, a),
        50 +- 0.5 with the actions' differences deciding, or a random-init softmax near 1 / classes, are judged by their
        argmax, and a tolerance below a common offset's spread would roll back mere bfloat16 rounding (0.125 at 50).
        Where the decision is pinned but the band is not vacuous by the offset, the values still bound the head. A
        softmax is no exception either way: a trained one's dominant column, 0.954 +- 0.003 in argmax 0 for every case,
        is refused, a random init's 0.25 +- 0.002 whose argmax varies is not. (b) reads rtol's part of the band alone, as
        4e8ff39 set it: a pinned head whose spread is below atol + rtol x |mean| but not below rtol x |mean| (-0.5 +- 0.012
        always below 0, or a random init's logits, 0.15 +- 0.03, one argmax for every case) is taken, though the same
        argument holds there; nor is a tolerance given to this refusal vetted beyond (b) (rtol 0 passes whatever atol)."""
        spreads = self._spreads()
        for name in sorted(self.measured):
            columns = spreads.get(name, ())
            tolerance = self.rule.tolerance(name)
            vacuous = [(c, mean, std) for c, (mean, std) in enumerate(columns) if std > 0 and tolerance.rtol * abs(mean) >= std]
            if not vacuous:
                continue
            decision = self.pinned(name)
            if decision is None:
                continue
            c, mean, std = vacuous[0]
            key = name if name in self.rule.outputs else "*"
            band = tolerance.atol + tolerance.rtol * abs(mean)
            where = f"column {c} of output '{name}'" if len(columns) > 1 else f"output '{name}'"
            below = 0.5 * min(sd for _, sd in columns if sd > 0)  # every column's: ``decisions: false`` vets them all
            return (f"params.yaml: acceptance.outputs.{key}: output '{name}' decides the same for every case of the FP32 "
                    f"reference ({decision}), and the band at the mean of {where}, atol {tolerance.atol:g} + rtol "
                    f"{tolerance.rtol:g} x |{mean:.6g}| = {band:.3g}, is wider than its values' spread (standard deviation "
                    f"{std:.3g}), so a trial answering the mean for every case would pass its values and its decisions; give "
                    f"'{name}' a tolerance below its spread, for example {{atol: {below:.2g}, rtol: 0}} (with decisions: false "
                    f"if the head is no decision)")
        return None

    def _undecided(self, name: str, v: torch.Tensor, primary: bool) -> bool:
        """Whether ``name`` is a regression's other output shaped like class scores ([N, C >= 2], [N, T, C]) that neither
        its name (``heads.scored``) nor its entry (``decisions``) says decided or not."""
        return (self.kind == "regression" and not primary and v.ndim in (2, 3) and v.shape[-1] >= 2
                and self.rule.tolerance(name).decisions is None and self.rule.tolerance(name).role is None
                and not heads.scored(self.rule.tolerance(name), name, self.kind))

    def _note_unit(self, name: str, v: torch.Tensor, row: int) -> None:
        """The range of single-value head ``name`` in rows ``row`` on (per token: at the positions the batch's
        ``attention_mask`` keeps, as compare reads them), into ``unit``."""
        values = v.detach()
        if v.ndim == 3 and self.token_mask is not None and self.token_mask.shape[1] == v.shape[1]:
            values = values[self.token_mask[row : row + v.shape[0]].bool()]
        finite = values[torch.isfinite(values)].double()
        if finite.numel():
            lo, hi, between = self.unit.setdefault(name, [math.inf, -math.inf, False])
            self.unit[name] = [min(lo, float(finite.min())), max(hi, float(finite.max())),
                               between or bool(((finite > 0) & (finite < 1)).any())]

    def probability_rows(self) -> list[str]:
        """The decided outputs whose every reference row is a probability distribution (a softmax's output): compare
        takes class scores through softmax for KL and probability margins, where probabilities would be softmaxed again."""
        return sorted(name for name, every in self.softmaxed.items() if every)

    def misnamed_probabilities(self) -> list[str]:
        """The decided single-value heads named like a probability (``holds_probabilities``: decided at 0.5) whose
        reference holds a finite value outside [0, 1] (a log-probability, a logit): no probability, and no flip counted."""
        return sorted(name for name, (lo, hi, _) in self.unit.items() if not _guessed(name) and (lo < 0 or hi > 1))

    def unit_heads(self) -> list[str]:
        """The decided single-value heads whose name says neither probability nor logit and whose every finite reference
        value lies in [0, 1], some strictly between: compare would guess a probability (``holds_probabilities``), decided
        at 0.5, where a logit is decided at 0. Only 0s and 1s (a decision already, or a bool) read the same either way."""
        return sorted(name for name, (lo, hi, between) in self.unit.items() if _guessed(name) and 0 <= lo and hi <= 1 and between)

    def channels_first(self) -> dict[str, tuple[int, str]]:
        """Per decided output [N, a, L] whose last axis is a length of the task's positions (``lengths``; besides the
        primary, a per-token primary's T) and whose axis 1 is none (nor the input's channels: ``channels``): its argmax
        over L, where the classes are its axis 1 (a Conv1d's scores, channels first), would count no class flip. The
        length and where it is known from. No length known (a per-case primary, no mask, no token ids, no sequence input):
        [N, T, C] and [N, C, T] cannot be told apart, and nothing is refused."""
        main = primary_name(self.shapes)
        out = {}
        for name in decided_heads(self.kind, self.rule, {n: (0, *s) for n, s in self.shapes.items()}, main):
            lengths = dict(self.lengths)
            if name != main and self.kind == "classification" and len(self.shapes[main]) == 2:
                lengths.setdefault(self.shapes[main][0], f"the tokens of the primary '{main}'")
            shape = self.shapes[name]
            if len(shape) == 2 and shape[-1] in lengths and shape[0] not in lengths and shape[0] not in self.channels:
                out[name] = (shape[-1], lengths[shape[-1]])
        return out

    def rms(self) -> dict[str, float]:
        """Per output, its RMS over the whole set or over the ordinary cases, whichever is smaller (the scale an atol must
        be below)."""
        return {name: min(_rms(total, count) for total, count in parts if count) if any(c for _, c in parts) else 0.0
                for name, parts in self.squares.items()}

    def whole_numbers(self) -> dict[str, float]:
        """Per output whose every reference value is a whole number, beyond 0 and 1: its largest magnitude."""
        return {name: top for name, top in self.whole.items() if top is not None and top > 1}

    def column_rms(self) -> dict[str, tuple[float, ...]]:
        """Per output of values of several columns (``moments``): the RMS of each column, the smaller of the whole set's
        and the ordinary cases'."""
        out = {}
        for name, parts in self.moments.items():
            if name in self.measured:  # decided: its columns are scores of one scale, unless an offset says (``spreads``)
                continue
            scales = [(squares / rows).sqrt() for _, squares, rows in parts if rows]
            if scales and scales[0].numel() >= 2:
                out[name] = tuple(torch.stack(scales).amin(0).tolist()) if scales else ()
        return out

    def nonfinite_rows(self, row: int, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows of ``chunk`` (from ``row``) whose outputs are not finite where compare judges them
        (``streams.nonfinite_rows``): what freeze refuses in the reference."""
        return streams.nonfinite_rows(self.kind, self.rule, chunk, row, self.targets, self.token_mask,
                                      self._position_heads(chunk))

    def _position_heads(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Which outputs are scores over positions (``streams.position_heads``), read once, from the first chunk's names and
        the whole set's shapes."""
        if self.positions is None:
            shapes = {n: (len(self.has_target), *t.shape[1:]) for n, t in chunk.items()}
            self.positions = streams.position_heads(self.kind, self.rule, shapes, primary_name(chunk), self.targets,
                                                    self.has_target, self.token_mask)
        return self.positions

    def problem(self, ref_steps: Sequence[StepRecord], replicates: Sequence[Sequence[StepRecord]] = (),
                spread: FP32Spread | None = None) -> str | None:
        """The first reason the rule cannot judge this reference (``refusals.problem``; ``replicates``: each FP32 noise
        replicate's steps; ``spread``: their quality after training beside the reference's), or None."""
        if self.every_shape:
            main = primary_name(self.every_shape)
            stated = heads.role_problem(self.kind, self.rule, self.every_shape, main, self.positions or {})
            if stated:
                return stated
        return refusals.problem(self.rule, self.facts(ref_steps, replicates, spread)) or self.pinned_offset()

    def facts(self, ref_steps: Sequence[StepRecord], replicates: Sequence[Sequence[StepRecord]] = (),
              spread: FP32Spread | None = None) -> refusals.Facts:
        """The record of the reference's facts that ``refusals`` vets the rule against."""
        return refusals.Facts(
            self.kind, self.shapes, self.rms(), self.quality.result(), self.metric.name, self.metric.higher_is_better,
            ref_steps, columns=self.column_rms(), spreads=self.spreads(), whole_numbers=self.whole_numbers(),
            distributions=sorted(n for n, every in self.distributions.items() if every), real_units=self.real_units(),
            tokens=self.tokens(), masked=self.masked, channels_first=self.channels_first(), unit_heads=self.unit_heads(),
            misnamed=self.misnamed_probabilities(), probability_rows=self.probability_rows(), top_k=self.metric.top_k,
            replicate=replicates[0] if replicates else None, more_replicates=replicates[1:],
            with_target=self.quality.scored(), logit_like=self.logit_like(), per_label=self.per_label, spread=spread)

    def logit_like(self) -> str | None:
        """The primary read as a value fitted to labels (``fitted``) when more than a tenth of its reference values lie
        outside [-0.5, 1.5], where values fitted to 0 or 1 stay and a sigmoid's logits do not, or when read at 0 it gets
        more than a tenth more of its labels right than at 0.5 (a logit trained on noisy labels stays near 0); else None."""
        if self.fitted is None or not self.fitted[1]:
            return None
        outside, values, at_half, at_zero, labels = self.fitted
        if outside <= 0.1 * values and not (labels and at_zero - at_half > 0.1 * labels):
            return None
        return primary_name(self.shapes)

    def roles(self) -> heads.Roles:
        """The role table of the reference's outputs, as compare will judge them (``heads.resolve``)."""
        main = primary_name(self.every_shape)
        probabilities = {n: heads.says_probability(n) or n in self.unit and 0 <= self.unit[n][0] and self.unit[n][1] <= 1
                         for n in self.every_shape}
        per_token = self.kind == "classification" and len(self.every_shape[main]) == 3
        return heads.resolve(self.kind, self.rule, self.every_shape, main, threshold=self.threshold,
                             over_positions=self.positions or {}, probabilities=probabilities, scales=self.rms(),
                             per_token=per_token, token_mask=self.token_mask is not None,
                             labels=self.kind == "regression" and task.binary_targets(self.targets, self.has_target))

    def real_units(self) -> int:
        """The fewest units of the flip rate's sample (ordinary cases, ``decisions.rate_sample``; per token, their kept
        positions) among the decisions the rule judges one by one, each against ``max_flip_rate``: the primary's (a
        regression's too), and every other decided output's, per case where it is one value or one row of scores per case."""
        real = self.drawn
        cases = int(real.sum())
        if not self.shapes:
            return cases
        main = primary_name(self.shapes)
        shapes = {n: (0, *s) for n, s in self.shapes.items()}
        per_case_heads = [n for n in (*decided_heads(self.kind, self.rule, shapes, main),
                                      *sign_heads(self.kind, self.rule, shapes, main))
                          if n != main and len(self.shapes[n]) <= 1]
        if self.kind == "classification" and len(self.shapes[main]) == 2 and self.targets.ndim == 2 and not per_case_heads:
            return int(((self.targets != task.IGNORE_INDEX) & real[:, None]).sum())
        return cases

    def tokens(self) -> int | None:
        """The tokens with a target of a per-token classifier's ordinary cases (what top-1 agreement's bound is taken
        over: ``decisions.rate_sample``), else None."""
        if self.kind == "classification" and self.shapes and len(self.shapes[primary_name(self.shapes)]) == 2 \
                and self.targets.ndim == 2:
            return int(((self.targets != task.IGNORE_INDEX) & self.drawn[:, None]).sum())
        return None


def _rms(total: float, count: int) -> float:
    return math.sqrt(total / count)


def _scaled(values: torch.Tensor, judged: torch.Tensor | None, scores: bool) -> torch.Tensor:
    """``values`` as their scale is measured (``Scan.rms``): NaN where compare judges nothing (a padding position: ``judged``,
    [rows, T]) and, in class scores (``scores``), at a class of probability 0 (``gaps.zero_probability``: a masked class,
    finfo.min, -1e9 or -inf): no score of the model's."""
    if judged is not None and values.ndim in (2, 3):  # per token [rows, T, ...], or a value per position [rows, T]
        values = values.masked_fill(~judged.reshape(*judged.shape, *[1] * (values.ndim - judged.ndim)), math.nan)
    if scores and values.ndim >= 2 and values.shape[-1] >= 2:
        values = values.masked_fill(zero_probability(values), math.nan)
    return values


MASKING = -1e30
"""At or below this, a class score is a masking value, not a score: ``masked_fill(~allowed, torch.finfo(dtype).min)``
writes -3.4e38 under FP32 (-65504 under a float16 trial), far below any score a layer computes."""


def masking_value(v: torch.Tensor) -> float | None:
    """The lowest masking value of class scores ``v`` (over its last axis), or None where it holds none: a finite score
    at or below ``MASKING`` (``finfo(float32).min``), or -inf in a row whose maximum is finite (``masked_fill`` with
    -inf; a row of -inf alone masks nothing to tell apart)."""
    v = v.detach()
    low = v <= MASKING  # NaN compares False
    if not v.numel() or not bool(low.any()):
        return None
    low &= torch.isfinite(v) | torch.isfinite(v.amax(-1, keepdim=True))
    return float(v[low].min()) if bool(low.any()) else None


def _guessed(name: str) -> bool:
    """Whether a single-value head's name says neither probability nor logit (``holds_probabilities`` then guesses)."""
    return not heads.says_probability(name) and not heads.says_logit(name)


def _positions(x) -> tuple[dict[int, str], set[int]]:
    """The lengths the task's positions may have, each with where it is known from (the batch's ``attention_mask`` [N, T];
    token ids [N, T], the bare input or ``input_ids``; a sequence [N, channels, L], the bare input's last axis), and the
    channels of such a sequence (an output's axis 1 of that size is no channels-first head: ``Scan.channels_first``)."""
    lengths, channels = {}, set()
    mask = task.token_mask_of(x)
    if mask is not None:
        lengths[mask.shape[1]] = "the batch's attention_mask"
    ids = x.get("input_ids") if isinstance(x, dict) else x
    if torch.is_tensor(ids) and ids.ndim == 2 and not ids.is_floating_point():
        lengths.setdefault(ids.shape[1], "the input's token ids")
    if torch.is_tensor(x) and x.ndim == 3 and x.is_floating_point():
        lengths.setdefault(x.shape[2], f"the input's length, [N, {x.shape[1]}, {x.shape[2]}]")
        channels.add(x.shape[1])
    return lengths, channels
