"""Element-wise gaps of a trial's outputs against the reference's, and both against the FP64 arbiter.

Streaming: ``GapStats`` and ``ArbiterStats`` are fed one chunk of rows at a time; memory does not grow with
the number of elements. ``value_gaps`` is ``GapStats`` fed once (the diagnosis ranks modules with it).

Precision: element-wise arithmetic runs in the outputs' own dtype (float32, or float64 for the FP64
arbiter; float16/bfloat16 are widened to float32); a slice's sum is taken in that dtype (pairwise,
relative error ~1e-6 in float32: for the reported means only) and slices are accumulated in float64;
counts and maxima are exact. An element fails where |t - r| > atol + rtol |r|: the test runs in float32,
whose rounding errs by at most 3 * 2**-24 * |t - r| at the threshold, and any slice whose worst element
comes within 2**-21 (|t - r| + atol) of failing is counted again in float64 (so counts are those of the
exact test; exact equality, atol = rtol = 0, is exact in float32 already: the float32 difference of two
float32 numbers is 0 only when they are equal). The common, passing slice never leaves float32.

Class scores decided through softmax (``softmax=True``: ``streams`` passes it for the decided heads): a pair whose
two sides both lie more than ``ZERO_PROBABILITY_NATS`` below their own row's maximum is at probability exactly 0 on
both sides (a masked class: ``finfo(dtype).min`` is -3.4e38 under FP32, -65504 under float16), so it agrees, is
counted apart (``zero_probability_both``) and left out of every statistic, where the output's values are known to be
read through softmax alone (``scores_only``: ``heads.score_heads``). A head decided only because nothing names it
features (a measurement [N, 3] beside a classifier) keeps its finite values judged, however far below its row's
maximum: only a pair with a masked side (-inf, below) is set aside there. Looked for only in a slice that would
fail, or whose largest gap exceeds that many nats (the common, passing slice does not pay for it). -inf is such a
score too, beside a finite maximum (``broken``: a masked class, ``masked_fill(~allowed, -inf)``, or a float16
trial's overflow of ``where(allowed, x, -1e9)``), not a non-finite output: masked on both sides it agrees; masked on
one side only, a probability from or to 0, it fails (a value change, not a non-finite element).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from pipeline.artifacts.comparison import Arbiter, KindGap, ValueGap
from pipeline.compare import native
from pipeline.compare.quantiles import StreamQuantile


ZERO_PROBABILITY_NATS = 104.0
"""How far below its row's maximum a class score is at softmax probability exactly 0 in float32, whatever the
other scores: its probability is at most exp(-104) = 6.8e-46, below 2**-150 = 7.0e-46 (half the smallest float32
subnormal, 1.4e-45 = exp(-103.28)), which round-to-nearest takes to 0 (``torch.softmax`` gives 0 from 103.98 below
on). The margin over ln(2**-150) = -103.972, 0.028 nats, is 7000 times the float32 rounding of score - max near
104 (3.8e-6). Float32 is the widest a score is compared in: inference records every output as float32, and the
distributions (KL, margins) are its softmaxes."""


def zero_probability(scores: torch.Tensor) -> torch.Tensor:
    """Where a score of ``scores`` [..., C] is at softmax probability 0 over its last axis (``ZERO_PROBABILITY_NATS``
    below its row's maximum; a row whose maximum is not finite has none). Exact: for a float32 or float64 score x and
    row maximum m, x < fl(m - 104) exactly when x < m - 104."""
    top = scores.amax(-1, keepdim=True)
    bar = torch.where(torch.isfinite(top), top - ZERO_PROBABILITY_NATS, torch.full_like(top, -math.inf))
    return scores < bar


def zero_probability_both(ref: torch.Tensor, trial: torch.Tensor) -> torch.Tensor:
    """Where both sides of [..., C] class scores are at softmax probability 0 (``zero_probability``), -inf included
    (a class masked out: ``masked_fill(~allowed, -inf)``, or a float16 trial's overflow of ``where(allowed, x, -1e9)``)."""
    return zero_probability(ref) & zero_probability(trial)


def broken(scores: torch.Tensor, softmax: bool = False) -> torch.Tensor:
    """Where an output's element is not finite as an output: NaN or an infinity; of class scores decided through
    softmax (``softmax``, [..., C]), -inf only in a row without a finite maximum: -inf beside a finite maximum is a
    class masked out, at probability exactly 0, as ``torch.softmax`` gives it (``zero_probability``)."""
    bad = ~torch.isfinite(scores)
    if softmax and scores.ndim >= 2 and scores.shape[-1] >= 2 and bool(bad.any()):
        bad &= ~(torch.isneginf(scores) & torch.isfinite(scores.amax(-1, keepdim=True)))
    return bad


def _widen(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.reshape(-1)


@dataclass
class _Tally:
    """The running counts of one case kind (``KindGap`` once frozen)."""

    elements: int = 0
    failing: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    nonfinite_trial_only: int = 0

    def frozen(self) -> KindGap:
        return KindGap(**{f.name: getattr(self, f.name) for f in fields(self)})


class GapStats:
    """Element-wise gap of a trial output against the reference, accumulated chunk by chunk.

    An element fails where |trial - ref| > atol + rtol * |ref|, or where the trial is non-finite and
    the reference is not (NaN in both counts as agreement, and is reported). Reported: max, mean and p99
    of absolute and relative error over finite pairs, and the smallest atol (at the given rtol) and rtol
    (at the given atol) that would have passed: reported, never applied. ``group`` (the case kind)
    gives the ``per_kind`` counts. ``softmax``: the output holds class scores over its last axis, decided
    through softmax; a pair at probability 0 on both sides with a masked side (-inf) agrees, apart from the statistics,
    and so does any such pair where ``scores_only`` (the default: with ``softmax``) says nothing else reads them
    (module docstring).
    """

    def __init__(self, atol: float, rtol: float, capacity: int, softmax: bool = False, scores_only: bool | None = None,
                 kernels: bool | None = None) -> None:
        self.atol, self.rtol = float(atol), float(rtol)
        self.kernels = native.wanted(capacity) if kernels is None else kernels and native.available()
        """Whether a slice's finite pairs go through ``native.gap_slice`` (by the output's size, ``capacity``)."""
        self.softmax = softmax
        self.scores_only = softmax if scores_only is None else softmax and scores_only
        """Finite pairs at probability 0 on both sides agree too (the module docstring)."""
        self.p_abs = StreamQuantile(0.99, capacity)
        self.p_rel = StreamQuantile(0.99, capacity)
        self.groups: dict[str, _Tally] = {}
        self.sum_abs = 0.0
        self.n_abs = 0
        self.sum_rel = 0.0
        self.n_rel = 0
        self.need_atol = 0.0
        self.need_rtol = 0.0
        self.nonfinite_reference = 0
        self.nonfinite_both = 0
        self.zero_probability_both = 0
        self.last_finite = True
        """Whether both sides of the last ``update`` were finite everywhere (known from its sum: callers skip
        their own element-wise test on it)."""
        self.last_max: float | None = None
        """The largest element of the gap the last ``update`` returned, when known without another pass (every
        pair finite, none set aside); else None."""
        self._scratch: torch.Tensor | None = None
        self.last_row_max: torch.Tensor | None = None
        """The largest gap of each row (leading index) the last ``update`` returned, when the kernel computed it; else
        None."""

    def update(self, ref: torch.Tensor, trial: torch.Tensor, group: str = "all",
               diff: torch.Tensor | None = None) -> torch.Tensor:
        """Add one chunk; return the largest absolute gap of each row (leading index; float64, inf where a pair is not
        finite, 0 for the pairs set aside at probability 0 on both sides: what the per-case table ranks). ``diff``:
        ``trial - ref`` when the caller has it already (of float32 or float64 sides of one dtype). A ``softmax``
        output's chunk keeps its rows whole ([..., C])."""
        if ref.shape != trial.shape:
            raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs trial {tuple(trial.shape)}")
        r, t = _widen(ref), _widen(trial)
        if r.dtype != t.dtype:
            r, t = r.double(), t.double()
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = _Tally()
        g.elements += r.numel()
        self.last_max = self.last_row_max = None
        if r.numel() == 0:
            self.last_finite = True
            return torch.zeros(ref.shape[:1], dtype=torch.float64, device=r.device)
        width = r.numel() // ref.shape[0] if ref.ndim else 1
        if self.kernels and width >= 64 and r.dtype == t.dtype == torch.float32 and r.device.type == "cpu":
            if self._kernel(g, r.contiguous(), t.contiguous(), width):
                return self.last_row_max.double()
        gap = torch.sub(t, r).abs_() if diff is None else diff.reshape(-1).abs()
        full_gap = gap
        total = _sum(gap)
        failing = 0
        both = None
        rows = (r, t, ref.shape[-1]) if self.softmax and ref.ndim >= 2 and ref.shape[-1] >= 2 else None
        self.last_finite = True  # a NaN or inf on either side makes the sum non-finite
        aside = None
        if not math.isfinite(total):  # some element of either side is not finite: the slow path, rarely taken
            fr, ft = torch.isfinite(r), torch.isfinite(t)
            both = fr & ft
            self.last_finite = bool(both.all())  # else the sum overflowed
            if rows is not None:  # class scores: -inf beside a finite maximum is a masked class (``broken``), no fault
                r2, t2 = rows[0].reshape(-1, rows[2]), rows[1].reshape(-1, rows[2])
                fr, ft = ~broken(r2, True).reshape(-1), ~broken(t2, True).reshape(-1)
                masking = fr & ft & ~both  # a class masked on one side at least
                aside = zero_probability_both(r2, t2).reshape(-1) & masking  # at probability 0 on both: they agree
                self.zero_probability_both += int(aside.sum())
                changed = int((masking & ~aside).sum())  # masked on one side only: a probability from or to 0
                failing += changed
                if changed:
                    self.need_atol = self.need_rtol = math.inf
            trial_only = int((fr & ~ft).sum())
            ref_bad = int((~fr).sum())
            same = int((~fr & ~ft & ((r == t) | (torch.isnan(r) & torch.isnan(t)))).sum())
            self.nonfinite_reference += ref_bad
            self.nonfinite_both += same
            g.nonfinite_trial_only += trial_only
            failing += trial_only + (ref_bad - same)
            if trial_only:
                self.need_atol = self.need_rtol = math.inf
            gap, r, t = gap[both], r[both], t[both]
            total = _sum(gap)
        dead = None
        if gap.numel():
            more, dead, mx = self._finite_pairs(g, r, t, gap, total, rows if self.scores_only else None, both)
            failing += more
        g.failing += failing
        if aside is not None:
            dead = aside if dead is None else dead | aside
        if dead is not None:  # the pairs set aside show no gap either (the per-case table's)
            full_gap = full_gap.masked_fill(dead, 0.0)
        elif both is None:
            self.last_max = mx
        if self.last_max is not None and ref.ndim and ref.shape[0] == 1:  # one row: its maximum is known
            return torch.tensor([self.last_max], dtype=torch.float64, device=full_gap.device)
        return torch.nan_to_num(full_gap.reshape(ref.shape[0] if ref.ndim else 1, -1).amax(1).double(), nan=math.inf)

    def _finite_pairs(self, g: _Tally, r: torch.Tensor, t: torch.Tensor, gap: torch.Tensor, total: float,
                      rows: tuple | None = None, both: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None, float]:
        """The statistics of finite pairs (flat ``r``, ``t``, their ``gap`` and its sum ``total``); their failing
        count, where the chunk's pairs at probability 0 on both sides were set aside (None: none were), and the
        largest of ``gap``.
        ``rows``: the chunk's whole sides (flat) and its row width, for a ``softmax`` output; ``both``: which of
        their elements ``r`` and ``t`` are (None: all)."""
        failing = 0
        mag = r.abs()
        mx = float(gap.amax())
        excess = torch.sub(gap, mag, alpha=self.rtol)  # gap - rtol |r|: fails where > atol
        worst = float(excess.amax())
        del excess
        near = worst > self.atol - 2.0**-21 * (mx + self.atol)
        if rows is not None and (near or mx > ZERO_PROBABILITY_NATS):  # rare: a class score may be masked on both sides
            r_all, t_all, width = rows
            dead_all = zero_probability_both(r_all.reshape(-1, width), t_all.reshape(-1, width)).reshape(-1)
            dead = dead_all if both is None else dead_all[both]
            n_dead = int(dead.sum())
            if n_dead:
                self.zero_probability_both += n_dead
                keep = ~dead
                gap = gap[keep]
                if gap.numel():
                    failing, _, _ = self._finite_pairs(g, r[keep], t[keep], gap, _sum(gap))
                return failing, dead_all, mx
        # The float32 test errs by at most 3 * 2**-24 * gap on an element at the threshold (gap ~ atol +
        # rtol |r|): only a slice whose worst comes that close to atol is counted, again, in float64
        # (the common, passing slice skips it; exact equality, atol = rtol = 0, is exact either way).
        if near:
            if r.dtype == torch.float64:
                exact = torch.sub(gap, mag, alpha=self.rtol)
            else:  # float32 inputs: their float64 difference is exact (unless 29 binades apart), |r| too
                exact = torch.sub(t.double(), r.double()).abs_().sub_(mag.double(), alpha=self.rtol)
            worst = float(exact.amax())
            failing += int((exact > self.atol).sum(dtype=torch.int64))
            del exact
        else:  # float32's worst may read low by its rounding: the reported need stays on the passing side
            worst += 2.0**-21 * (mx + self.atol)
        self.need_atol = max(self.need_atol, worst, 0.0)
        g.max_abs = max(g.max_abs, mx)
        self.sum_abs += total
        self.n_abs += gap.numel()
        self.p_abs.update(gap, finite=True, vmax=mx, nonneg=True)
        rel = gap / mag
        rmax = float(rel.amax())
        gap_nz, mag_nz = gap, mag
        if not math.isfinite(rmax):  # a zero reference (0/0, x/0) has no relative error; it passes through atol alone
            nz = mag > 0
            if bool((gap[~nz] > self.atol).any()):
                self.need_rtol = math.inf
            if not bool(nz.all()):
                rel, gap_nz, mag_nz = rel[nz], gap[nz], mag[nz]
                rmax = float(rel.amax()) if rel.numel() else 0.0
        if rel.numel():
            g.max_rel = max(g.max_rel, rmax)
            self.sum_rel += _sum(rel) if rmax * rel.numel() < 1e30 else float(rel.sum(dtype=torch.float64))
            self.n_rel += rel.numel()
            self.p_rel.update(rel, finite=True, vmax=rmax, nonneg=True)
            if self.atol == 0.0:
                self.need_rtol = max(self.need_rtol, rmax)
            elif mx > self.atol:
                self.need_rtol = max(self.need_rtol, float(torch.sub(gap_nz, self.atol).div_(mag_nz).amax()))
        return failing, None, mx

    def _kernel(self, g: _Tally, r: torch.Tensor, t: torch.Tensor, width: int) -> bool:
        """``_finite_pairs`` of a slice of rows of ``width`` pairs in one pass (``native.gap_slice``): the same counts,
        maxima and quantiles, sums in float64, each row's largest gap in ``last_row_max``. Whether it took the slice:
        not where torch's path must (a non-finite element, a worst element near the tolerance: float64's recount,
        class scores that may be masked on both sides), and then nothing is counted."""
        n = r.numel()
        if self._scratch is None or self._scratch.numel() < 2 * n + 4:  # reused slice after slice: no page to fault in
            self._scratch = torch.empty(2 * n + 4)
        kept_abs, kept_rel = self._scratch[: 2 * n].view(2, n)
        out_f, row_max = self._scratch[2 * n : 2 * n + 4], torch.empty(n // width)
        out_d, out_n = torch.empty(2, dtype=torch.float64), torch.empty(3, dtype=torch.int64)
        (abs_floor, abs_incl), (rel_floor, rel_incl) = self.p_abs.selection(), self.p_rel.selection()
        p = native.pointer
        if native.library().gap_slice(p(r), p(t), n, width, self.rtol, self.atol, abs_floor, abs_incl, rel_floor, rel_incl,
                                      None, p(row_max), p(kept_abs), p(kept_rel), p(out_f),
                                      p(out_d, native.F64), p(out_n, native.I64)):
            return False
        mx, worst, rmax, need = out_f.tolist()
        sum_gap, sum_rel = out_d.tolist()
        n_abs, n_rel, zero = out_n.tolist()
        if worst > self.atol - 2.0**-21 * (mx + self.atol) or (self.scores_only and mx > ZERO_PROBABILITY_NATS):
            return False
        self.need_atol = max(self.need_atol, worst + 2.0**-21 * (mx + self.atol), 0.0)
        g.max_abs = max(g.max_abs, mx)
        self.sum_abs += sum_gap
        self.n_abs += n
        self.p_abs.update_selected(kept_abs[:n_abs], n, mx)
        if n - zero:
            g.max_rel = max(g.max_rel, rmax)
            self.sum_rel += sum_rel
            self.n_rel += n - zero
            self.p_rel.update_selected(kept_rel[:n_rel], n - zero, rmax)
            if self.atol == 0.0:
                self.need_rtol = max(self.need_rtol, rmax)
            elif mx > self.atol:
                self.need_rtol = max(self.need_rtol, need)
        self.last_finite, self.last_max, self.last_row_max = True, mx, row_max
        return True

    def failing_rows(self, ref: torch.Tensor, trial: torch.Tensor) -> torch.Tensor:
        """Rows with an element that fails (as ``update`` counts it, in float64): for naming the cases."""
        r, t = ref.detach().double().reshape(ref.shape[0], -1), trial.detach().double().reshape(trial.shape[0], -1)
        same_nonfinite = (torch.isnan(r) & torch.isnan(t)) | (torch.isinf(r) & (r == t))
        outside = (t - r).abs() - self.rtol * r.abs() > self.atol
        bad = outside | (torch.isfinite(r) & ~torch.isfinite(t)) | (~torch.isfinite(r) & ~same_nonfinite)
        if self.softmax and ref.ndim >= 2 and ref.shape[-1] >= 2:  # a pair at probability 0 on both sides agrees
            width = ref.shape[-1]
            agree = zero_probability_both(r.reshape(-1, width), t.reshape(-1, width)).reshape(r.shape)
            bad &= ~(agree if self.scores_only else agree & (torch.isneginf(r) | torch.isneginf(t)))
        return bad.any(1)

    def failing_so_far(self) -> int:
        return sum(g.failing for g in self.groups.values())

    def nonfinite_so_far(self) -> int:
        """Non-finite trial elements so far (the reference's are refused at freeze)."""
        return sum(g.nonfinite_trial_only for g in self.groups.values()) + self.nonfinite_reference

    def result(self) -> ValueGap:
        groups = self.groups.values()
        n = sum(g.elements for g in groups)
        failing = sum(g.failing for g in groups)
        return ValueGap(
            elements=n,
            failing=failing,
            failing_fraction=failing / n if n else 0.0,
            nonfinite_trial_only=sum(g.nonfinite_trial_only for g in groups),
            nonfinite_reference=self.nonfinite_reference,
            nonfinite_both=self.nonfinite_both,
            zero_probability_both=self.zero_probability_both if self.softmax else None,
            max_abs=max((g.max_abs for g in groups), default=0.0),
            mean_abs=self.sum_abs / self.n_abs if self.n_abs else 0.0,
            p99_abs=self.p_abs.result(),
            max_rel=max((g.max_rel for g in groups), default=0.0),
            mean_rel=self.sum_rel / self.n_rel if self.n_rel else 0.0,
            p99_rel=self.p_rel.result(),
            p99_exact=self.p_abs.exact,
            atol=self.atol,
            rtol=self.rtol,
            min_passing_atol=round_up(self.need_atol),
            min_passing_rtol=round_up(self.need_rtol),
            per_kind={k: v.frozen() for k, v in sorted(self.groups.items())},
        )


def round_up(x: float, digits: int = 4) -> float:
    """``x`` rounded UP to ``digits`` significant decimal digits: the smallest passing tolerance a reviewer
    copies from the report must pass the exact test, not fail it by one rounding (as rounding to nearest would)."""
    if not math.isfinite(x) or x <= 0.0:
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    up = math.ceil(x / step) * step
    return up if up >= x else up + step


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: from its sum (one fast pass; any NaN or inf makes it non-finite),
    element by element only where the sum is not finite (an overflow of finite values) or the dtype is narrow."""
    if not t.is_floating_point():
        return True
    if t.dtype in (torch.float32, torch.float64) and math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _sum(v: torch.Tensor) -> float:
    """Sum of one slice in its own dtype (pairwise: relative error ~1e-6 in float32), to be accumulated
    across slices in a Python float (float64)."""
    return float(v.sum())


def value_gaps(ref: torch.Tensor, trial: torch.Tensor, atol: float, rtol: float, softmax: bool = False,
               scores_only: bool | None = None) -> ValueGap:
    """``GapStats`` over one pair of tensors (see there), as one kind (``per_kind`` holds ``all`` alone)."""
    acc = GapStats(atol, rtol, ref.numel(), softmax=softmax, scores_only=scores_only)
    acc.update(ref, trial)
    return acc.result()


class ArbiterStats:
    """Dynamo-style check: how far AMP is from FP64, compared with how far FP32 is from FP64 (RMSE)."""

    def __init__(self) -> None:
        self.n, self.ref_sq, self.amp_sq = 0, 0.0, 0.0

    def update(self, ref: torch.Tensor, trial: torch.Tensor, fp64: torch.Tensor) -> None:
        a = fp64.detach().double().reshape(-1)
        self.n += a.numel()
        if a.numel():
            d = ref.detach().reshape(-1).double() - a
            self.ref_sq += float(torch.dot(d, d))
            d = trial.detach().reshape(-1).double() - a
            self.amp_sq += float(torch.dot(d, d))

    def result(self, cases: int | None = None) -> Arbiter:
        """``cases``: how many of the fixed set's cases the FP64 outputs covered, when fewer than all."""
        ref_rmse = math.sqrt(self.ref_sq / self.n) if self.n else 0.0
        amp_rmse = math.sqrt(self.amp_sq / self.n) if self.n else 0.0
        return Arbiter(
            fp32_rmse_vs_fp64=ref_rmse,
            amp_rmse_vs_fp64=amp_rmse,
            amp_over_fp32=amp_rmse / ref_rmse if ref_rmse > 0 else (math.inf if amp_rmse > 0 else 1.0),
            cases=cases,
        )

