"""Pure numerics of the comparison: value gaps, decisions, flips, distribution agreement, quality, trajectories.

No file I/O, no MLflow, no globals: tensors and plain values in, plain dicts out.

Streaming: every statistic over outputs has an accumulator fed one chunk of rows at a time
(``GapStats``, ``ArbiterStats``, ``DecisionStats``, ``QualityStats``); memory does not grow with the
number of elements, only with the number of cases for per-case summaries (a few numbers per case).
The one-shot functions (``value_gaps``, ``classification_flips``...) are those accumulators fed once.

Precision: element-wise arithmetic runs in the outputs' own dtype (float32, or float64 for the FP64
arbiter; float16/bfloat16 are widened to float32); a slice's sum is taken in that dtype (pairwise,
relative error ~1e-6 in float32: for the reported means only) and slices are accumulated in float64;
counts and maxima are exact. An element fails where |t - r| > atol + rtol |r|: the test runs in float32,
whose rounding errs by at most 3 * 2**-24 * |t - r| at the threshold, and any slice whose worst element
comes within 2**-21 (|t - r| + atol) of failing is counted again in float64 (so counts are those of the
exact test; exact equality, atol = rtol = 0, is exact in float32 already: the float32 difference of two
float32 numbers is 0 only when they are equal). The common, passing slice never leaves float32.

Quantiles: ``quantile`` (exact nearest rank, via ``kthvalue``, no sort) for a tensor in memory;
``StreamQuantile`` for a stream: exact while the largest (1 - q) share of the stream fits in
``MAX_EXACT`` values (p99 of up to 6.5e6 values: it keeps only those, merged with numpy's partition),
else a histogram of the float32 bit patterns (exponent and top 10 mantissa bits, one ``bincount`` per
slice) whose answer is within a relative error ``SKETCH_ALPHA`` = 2**-11 of the exact nearest-rank
value and never above the exact maximum. Either way the answer does not depend on the chunking.
"""

from __future__ import annotations

import math
import struct
from typing import Callable, Sequence

import torch

from pipeline.errors import UserError

IGNORE_INDEX = -100
"""Per-token targets equal to this are ignored (Hugging Face's convention)."""

MAX_EXACT = 1 << 16
"""Most values a ``StreamQuantile`` keeps for an exact answer (256 KiB in float32; it holds at most
twice that plus ``SLACK`` between merges): p99 of up to 6.5e6 values stays exact; beyond, the histogram."""
SLACK = 1 << 18
"""Values gathered above the current floor before the kept values are merged (one partition)."""
HIST_SHIFT = 13
"""The histogram's key of a float32 value >= 0 is its bit pattern shifted right by this: the 8 exponent
bits and the top 23 - 13 = 10 mantissa bits. A bucket [lo, hi) then has (hi - lo) / lo <= 2**-10."""
SKETCH_ALPHA = 2.0**-11
"""Relative error bound of the histogram's answer: the middle of the bucket holding the exact nearest-rank
value, clamped to the exact maximum (values below ``HIST_FLOOR``: 0, absolute error < ``HIST_FLOOR``)."""
HIST_FLOOR = 2.0**-40
_KEY_FLOOR = (127 - 40) << (23 - HIST_SHIFT)  # key of HIST_FLOOR: smaller values share bucket 0
_KEY_INF = 0x7F800000 >> HIST_SHIFT  # key of +inf, the largest

MARGIN_KINDS = ("logit", "probability", "relative")


# ----------------------------------------------------------------------------------------------------
# Quantiles


def quantile(values: torch.Tensor | Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least ``q`` of the values at or below it.

    Exact, no size limit (unlike ``torch.quantile``), no full sort (``kthvalue``); 0.0 when empty.
    NaN values are ignored. The one quantile of the project: use it for timings as well.
    """
    v = values if torch.is_tensor(values) else torch.tensor(list(values), dtype=torch.float64)
    v = v.detach().flatten()
    if v.is_floating_point():
        v = v[~torch.isnan(v)]
    if v.numel() == 0:
        return 0.0
    rank = min(max(math.ceil(q * v.numel()), 1), v.numel())
    return float(v.kthvalue(rank).values)


class StreamQuantile:
    """Nearest-rank quantile ``q`` (>= 0.5) of values arriving in chunks, in bounded memory.

    ``capacity`` is an upper bound of how many values will arrive (the number of elements): the answer
    is the (n - ceil(q n) + 1)-th largest of the n values seen, so keeping the ``(1 - q) capacity + 2``
    largest is enough for an exact answer. When that exceeds ``max_exact``, values go to a histogram of
    their float32 bit patterns instead (``HIST_SHIFT``: exponent and top 10 mantissa bits, one
    ``bincount`` per chunk, no sort, no selection, a fixed 1.4 MB of counts): the answer is then within a
    relative error ``SKETCH_ALPHA`` (2**-11) of the exact nearest-rank value, never above the exact
    maximum, and order-independent (counts add), so any chunking gives the same answer. The attribute
    ``exact`` says which. NaN values are ignored (callers count them); negative values are kept aside
    exactly (none in the pipeline's uses: gaps, relative errors and KL are >= 0).
    """

    def __init__(self, q: float, capacity: int, alpha: float = SKETCH_ALPHA, max_exact: int = MAX_EXACT) -> None:
        if not 0.5 <= q <= 1.0:
            raise ValueError(f"StreamQuantile keeps the largest values: q must be in [0.5, 1], got {q}")
        self.q, self.n = q, 0
        self.keep = int(math.floor((1.0 - q) * capacity)) + 2
        self.exact = self.keep <= max_exact
        self.alpha = SKETCH_ALPHA  # fixed by HIST_SHIFT; ``alpha`` is accepted for compatibility
        self._parts: list[torch.Tensor] = []
        self._held = 0
        self._floor = -math.inf
        self._max = -math.inf
        self._negatives: list[torch.Tensor] = []
        self._hist = None if self.exact else torch.zeros(_KEY_INF - _KEY_FLOOR + 1, dtype=torch.int64)
        self.merges = 0

    def update(self, values: torch.Tensor, finite: bool = False, vmax: float | None = None, nonneg: bool = False) -> None:
        """Add values (``finite``: the caller guarantees no NaN; ``vmax``: their maximum, when known;
        ``nonneg``: the caller guarantees no negative value: each saves a pass)."""
        v = values.detach().flatten()
        if not finite and v.is_floating_point() and bool(torch.isnan(v).any()):
            v = v[~torch.isnan(v)]
        self.n += v.numel()
        if v.numel() == 0:
            return
        if self.exact:
            if vmax is not None and vmax <= self._floor:
                return  # nothing here is among the largest kept
            if self._floor > -math.inf:
                v = v[v > self._floor]
            if v.numel():
                self._parts.append(v.clone() if v.data_ptr() == values.data_ptr() else v)  # never a view of the caller's
                self._held += v.numel()
            if self._held > 2 * self.keep + SLACK:
                self._shrink()
            return
        if v.dtype != torch.float32:
            v = v.float()  # float64 (KL) rounded to float32: 2**-24 relative, far below the bucket width
        if not nonneg and float(v.min()) < 0:
            negative = v < 0
            self._negatives.append(v[negative].double())
            v = v[~negative]
            if v.numel() == 0:
                return
        self._max = max(self._max, float(v.max()) if vmax is None else float(vmax))
        key = torch.bitwise_right_shift(v.contiguous().view(torch.int32), HIST_SHIFT)  # >= 0: the order of the values
        counts = torch.bincount(key.clamp_(min=_KEY_FLOOR).sub_(_KEY_FLOOR))
        self._hist[: counts.numel()] += counts

    def _shrink(self) -> None:
        """Keep the ``keep`` largest values: numpy's in-place partition (introselect) of the gathered values;
        ``topk`` or ``kthvalue`` with a large k allocate int64 indices as large as their input."""
        allv = torch.cat(self._parts) if len(self._parts) > 1 else self._parts[0].clone()
        self._parts = []
        self.merges += 1
        if allv.numel() <= self.keep:
            self._parts, self._held = [allv], allv.numel()
            return
        a = allv.numpy()
        cut = a.size - self.keep
        a.partition(cut)  # a[cut] is the keep-th largest, everything after it is >= it
        top = torch.from_numpy(a[cut:].copy())
        del allv, a
        self._parts, self._held = [top], top.numel()
        self._floor = float(top[0])

    def result(self) -> float:
        if self.n == 0:
            return 0.0
        rank = min(max(math.ceil(self.q * self.n), 1), self.n)
        from_top = self.n - rank + 1  # 1 = the largest
        if self.exact:
            a = torch.cat(self._parts).numpy().copy() if self._parts else torch.zeros(0).numpy()
            kth = a.size - from_top
            a.partition(kth)
            return float(a[kth])
        above = torch.flip(self._hist, [0]).cumsum(0)  # values in this bucket or above, from the top bucket down
        if int(above[-1]) < from_top:  # among the negatives
            negatives = torch.cat(self._negatives)
            return float(negatives.topk(from_top - int(above[-1])).values[-1])
        bucket = self._hist.numel() - 1 - int(torch.searchsorted(above, from_top))
        if bucket == 0:
            return 0.0  # below HIST_FLOOR
        key = bucket + _KEY_FLOOR
        if key >= _KEY_INF:
            return math.inf
        lo, hi = _from_bits(key << HIST_SHIFT), _from_bits((key + 1) << HIST_SHIFT)
        return min(0.5 * (lo + hi), self._max)

    def upper(self) -> float:
        """A value never below the exact nearest-rank quantile: ``result`` when exact, else the upper edge of
        the histogram bucket holding it (clamped to the exact maximum). Gates read this one."""
        if self.exact or self.n == 0:
            return self.result()
        estimate = self.result()
        if estimate <= 0.0:
            return HIST_FLOOR if self._max > 0 else 0.0
        if not math.isfinite(estimate):
            return estimate
        key = struct.unpack("<i", struct.pack("<f", estimate))[0] >> HIST_SHIFT
        return min(_from_bits((key + 1) << HIST_SHIFT), self._max)


def _from_bits(bits: int) -> float:
    """The float32 whose bit pattern is ``bits``."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


# ----------------------------------------------------------------------------------------------------
# Value gaps


def _widen(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.reshape(-1)


class GapStats:
    """Element-wise gap of a trial output against the reference, accumulated chunk by chunk.

    An element fails where |trial - ref| > atol + rtol * |ref|, or where the trial is non-finite and
    the reference is not (NaN in both counts as agreement, and is reported). Reported: max, mean and p99
    of absolute and relative error over finite pairs, and the smallest atol (at the given rtol) and rtol
    (at the given atol) that would have passed: reported, never applied. ``group`` (the case kind)
    gives the ``per_kind`` counts.
    """

    PER_KIND = ("elements", "failing", "max_abs", "max_rel", "nonfinite_trial_only")

    def __init__(self, atol: float, rtol: float, capacity: int) -> None:
        self.atol, self.rtol = float(atol), float(rtol)
        self.p_abs = StreamQuantile(0.99, capacity)
        self.p_rel = StreamQuantile(0.99, capacity)
        self.groups: dict[str, dict] = {}
        self.sum_abs = 0.0
        self.n_abs = 0
        self.sum_rel = 0.0
        self.n_rel = 0
        self.need_atol = 0.0
        self.need_rtol = 0.0
        self.nonfinite_reference = 0
        self.nonfinite_both = 0

    def update(self, ref: torch.Tensor, trial: torch.Tensor, group: str = "all") -> torch.Tensor:
        """Add one chunk; return the absolute gap per element (shape of ``ref``, NaN/inf where non-finite)."""
        if ref.shape != trial.shape:
            raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs trial {tuple(trial.shape)}")
        r, t = _widen(ref), _widen(trial)
        if r.dtype != t.dtype:
            r, t = r.double(), t.double()
        g = self.groups.setdefault(group, {"elements": 0, "failing": 0, "max_abs": 0.0, "max_rel": 0.0, "nonfinite_trial_only": 0})
        g["elements"] += r.numel()
        if r.numel() == 0:
            return torch.zeros(ref.shape, dtype=r.dtype)
        gap = torch.sub(t, r).abs_()
        full_gap = gap
        total = _sum(gap)
        failing = 0
        both = None
        if not math.isfinite(total):  # some element of either side is not finite: the slow path, rarely taken
            fr, ft = torch.isfinite(r), torch.isfinite(t)
            both = fr & ft
            trial_only = int((fr & ~ft).sum())
            ref_bad = int((~fr).sum())
            same = int((~fr & ~ft & ((r == t) | (torch.isnan(r) & torch.isnan(t)))).sum())
            self.nonfinite_reference += ref_bad
            self.nonfinite_both += same
            g["nonfinite_trial_only"] += trial_only
            failing += trial_only + (ref_bad - same)
            if trial_only:
                self.need_atol = self.need_rtol = math.inf
            gap, r = gap[both], r[both]
            total = _sum(gap)
        if gap.numel():
            mag = r.abs()
            mx = float(gap.max())
            excess = torch.sub(gap, mag, alpha=self.rtol)  # gap - rtol |r|: fails where > atol
            worst = float(excess.max())
            del excess
            # The float32 test errs by at most 3 * 2**-24 * gap on an element at the threshold (gap ~ atol +
            # rtol |r|): only a slice whose worst comes that close to atol is counted, again, in float64
            # (the common, passing slice skips it; exact equality, atol = rtol = 0, is exact either way).
            if worst > self.atol - 2.0**-21 * (mx + self.atol):
                if r.dtype == torch.float64:
                    exact = torch.sub(gap, mag, alpha=self.rtol)
                else:  # float32 inputs: their float64 difference is exact (unless 29 binades apart), |r| too
                    exact = torch.sub((t if both is None else t[both]).double(), r.double()).abs_().sub_(mag.double(), alpha=self.rtol)
                worst = float(exact.max())
                failing += int((exact > self.atol).sum(dtype=torch.int64))
                del exact
            else:  # float32's worst may read low by its rounding: the reported need stays on the passing side
                worst += 2.0**-21 * (mx + self.atol)
            self.need_atol = max(self.need_atol, worst, 0.0)
            g["max_abs"] = max(g["max_abs"], mx)
            self.sum_abs += total
            self.n_abs += gap.numel()
            self.p_abs.update(gap, finite=True, vmax=mx, nonneg=True)
            rel = gap / mag
            rmax = float(rel.max())
            gap_nz, mag_nz = gap, mag
            if not math.isfinite(rmax):  # a zero reference (0/0, x/0) has no relative error; it passes through atol alone
                nz = mag > 0
                if bool((gap[~nz] > self.atol).any()):
                    self.need_rtol = math.inf
                if not bool(nz.all()):
                    rel, gap_nz, mag_nz = rel[nz], gap[nz], mag[nz]
                    rmax = float(rel.max()) if rel.numel() else 0.0
            if rel.numel():
                g["max_rel"] = max(g["max_rel"], rmax)
                self.sum_rel += _sum(rel) if rmax * rel.numel() < 1e30 else float(rel.sum(dtype=torch.float64))
                self.n_rel += rel.numel()
                self.p_rel.update(rel, finite=True, vmax=rmax, nonneg=True)
                if self.atol == 0.0:
                    self.need_rtol = max(self.need_rtol, rmax)
                elif mx > self.atol:
                    self.need_rtol = max(self.need_rtol, float(torch.sub(gap_nz, self.atol).div_(mag_nz).max()))
        g["failing"] += failing
        return full_gap.reshape(ref.shape)

    def failing_rows(self, ref: torch.Tensor, trial: torch.Tensor) -> torch.Tensor:
        """Rows with an element that fails (as ``update`` counts it, in float64): for naming the cases."""
        r, t = ref.detach().double().reshape(ref.shape[0], -1), trial.detach().double().reshape(trial.shape[0], -1)
        same_nonfinite = (torch.isnan(r) & torch.isnan(t)) | (torch.isinf(r) & (r == t))
        outside = (t - r).abs() - self.rtol * r.abs() > self.atol
        bad = outside | (torch.isfinite(r) & ~torch.isfinite(t)) | (~torch.isfinite(r) & ~same_nonfinite)
        return bad.any(1)

    def failing_so_far(self) -> int:
        return sum(g["failing"] for g in self.groups.values())

    def nonfinite_so_far(self) -> int:
        """Non-finite trial elements so far (the reference's are refused at freeze)."""
        return sum(g["nonfinite_trial_only"] for g in self.groups.values()) + self.nonfinite_reference

    def result(self) -> dict:
        n = sum(g["elements"] for g in self.groups.values())
        failing = sum(g["failing"] for g in self.groups.values())
        return {
            "elements": n,
            "failing": failing,
            "failing_fraction": failing / n if n else 0.0,
            "nonfinite_trial_only": sum(g["nonfinite_trial_only"] for g in self.groups.values()),
            "nonfinite_reference": self.nonfinite_reference,
            "nonfinite_both": self.nonfinite_both,
            "max_abs": max((g["max_abs"] for g in self.groups.values()), default=0.0),
            "mean_abs": self.sum_abs / self.n_abs if self.n_abs else 0.0,
            "p99_abs": self.p_abs.result(),
            "max_rel": max((g["max_rel"] for g in self.groups.values()), default=0.0),
            "mean_rel": self.sum_rel / self.n_rel if self.n_rel else 0.0,
            "p99_rel": self.p_rel.result(),
            "p99_exact": self.p_abs.exact,
            "atol": self.atol,
            "rtol": self.rtol,
            "min_passing_atol": round_up(self.need_atol),
            "min_passing_rtol": round_up(self.need_rtol),
            "per_kind": {k: dict(v) for k, v in sorted(self.groups.items())},
        }


def round_up(x: float, digits: int = 4) -> float:
    """``x`` rounded UP to ``digits`` significant decimal digits: the smallest passing tolerance a reviewer
    copies from the report must pass the exact test, not fail it by one rounding (as rounding to nearest would)."""
    if not math.isfinite(x) or x <= 0.0:
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    up = math.ceil(x / step) * step
    return up if up >= x else up + step


def _sum(v: torch.Tensor) -> float:
    """Sum of one slice in its own dtype (pairwise: relative error ~1e-6 in float32), to be accumulated
    across slices in a Python float (float64)."""
    return float(v.sum())


def value_gaps(ref: torch.Tensor, trial: torch.Tensor, atol: float, rtol: float) -> dict:
    """``GapStats`` over one pair of tensors (see there); no ``per_kind``."""
    if ref.shape != trial.shape:
        raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs trial {tuple(trial.shape)}")
    acc = GapStats(atol, rtol, ref.numel())
    acc.update(ref, trial)
    out = acc.result()
    del out["per_kind"]
    return out


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

    def result(self) -> dict:
        ref_rmse = math.sqrt(self.ref_sq / self.n) if self.n else 0.0
        amp_rmse = math.sqrt(self.amp_sq / self.n) if self.n else 0.0
        return {
            "fp32_rmse_vs_fp64": ref_rmse,
            "amp_rmse_vs_fp64": amp_rmse,
            "amp_over_fp32": amp_rmse / ref_rmse if ref_rmse > 0 else (math.inf if amp_rmse > 0 else 1.0),
        }


def error_vs_arbiter(ref: torch.Tensor, trial: torch.Tensor, fp64: torch.Tensor) -> dict:
    acc = ArbiterStats()
    acc.update(ref, trial, fp64)
    return acc.result()


# ----------------------------------------------------------------------------------------------------
# Decisions


def decisions(scores: torch.Tensor, tie_rule: str, margin_kind: str = "logit") -> tuple[torch.Tensor, torch.Tensor]:
    """Class per row (per position for [N, T, C]) by argmax over the last dim, and the top-2 margin.

    Tie rule: ``lowest_index`` takes the lowest class index among the maxima; ``tie_is_flip`` marks a
    tie with -1, which never equals a reference class. A row with NaN decides -2 (no decision), margin NaN.
    ``margin_kind``: see ``margins``.
    """
    labels, top, lse = _top(scores, 2, tie_rule, need_lse=margin_kind == "probability")
    return labels, margins(top, margin_kind, lse, scores)


def labels_of(scores: torch.Tensor, tie_rule: str) -> torch.Tensor:
    """Decisions only (as ``decisions``), in one pass for ``lowest_index``: ``max`` gives the first maximal index."""
    s = scores.detach()
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()
    if s.numel() == 0:
        return torch.zeros(s.shape[:-1], dtype=torch.long)
    values, labels = s.max(dim=-1)
    if tie_rule == "tie_is_flip":
        labels = torch.where((s == values.unsqueeze(-1)).sum(-1) > 1, torch.full_like(labels, -1), labels)
    return torch.where(torch.isnan(values), torch.full_like(labels, -2), labels)


def _top(scores: torch.Tensor, k: int, tie_rule: str, need_lse: bool = False):
    """(labels, topk values and indices, log-sum-exp or None) over the last dim, one pass over the scores."""
    s = scores.detach()
    if s.ndim < 2 or s.shape[-1] < 2:
        raise ValueError(f"classification needs scores of shape [N, C>=2] or [N, T, C>=2], got {tuple(s.shape)}")
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()
    if s.numel() == 0:
        empty = torch.zeros(s.shape[:-1], dtype=torch.long)
        return empty, (torch.zeros(*s.shape[:-1], k, dtype=s.dtype), torch.zeros(*s.shape[:-1], k, dtype=torch.long)), (torch.zeros(s.shape[:-1], dtype=s.dtype) if need_lse else None)
    values, indices = s.topk(min(k, s.shape[-1]), dim=-1)  # NaN sorts above every number
    labels = indices[..., 0].clone()
    tied = values[..., 0] == values[..., 1]
    if bool(tied.any()):
        if tie_rule == "tie_is_flip":
            labels[tied] = -1
        else:  # the lowest index among the maxima (topk's order among equal values is unspecified)
            labels[tied] = s[tied].argmax(dim=-1)
    bad = torch.isnan(values[..., 0])
    if bool(bad.any()):
        labels[bad] = -2
    lse = torch.logsumexp(s, dim=-1) if need_lse else None
    return labels, (values, indices), lse


def _ties_differ(ref: torch.Tensor, trial: torch.Tensor, r_lab: torch.Tensor, t_lab: torch.Tensor) -> torch.Tensor:
    """Under ``tie_is_flip`` both sides tied (label -1): a flip unless they tie among the same classes."""
    both = (r_lab == -1) & (t_lab == -1)
    out = torch.zeros_like(both)
    if bool(both.any()):
        r, t = ref.detach()[both].float(), trial.detach()[both].float()
        out[both] = ((r == r.amax(-1, keepdim=True)) != (t == t.amax(-1, keepdim=True))).any(-1)
    return out


def margins(top, kind: str, lse: torch.Tensor | None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Top-2 margin of each decision, in float64, in the unit ``kind`` names:

    - ``logit``: z1 - z2, in the scores' own unit (depends on their scale);
    - ``probability``: p1 - p2 of the softmax, in [0, 1] (needs the log-sum-exp ``lse``);
    - ``relative``: (z1 - z2) / std(z) over the classes, in units of the row's own spread.
    """
    values = top[0].double()
    gap = values[..., 0] - values[..., 1]
    if kind == "logit":
        return gap
    if kind == "probability":
        lse = lse.double()
        return torch.exp(values[..., 0] - lse) - torch.exp(values[..., 1] - lse)
    if kind == "relative":
        spread = scores.detach().double().std(dim=-1) if scores.shape[-1] > 1 else torch.ones_like(gap)
        return torch.where(spread > 0, gap / spread, torch.zeros_like(gap))
    raise ValueError(f"unknown margin kind {kind!r}; use one of {MARGIN_KINDS}")


def kl_per_position(ref_scores: torch.Tensor, trial_scores: torch.Tensor, diff: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(ref) || softmax(trial)) over the last dim, per row / position, in float64 (see ``kl_and_lse``)."""
    return kl_and_lse(ref_scores, trial_scores, diff)[0]


def kl_and_lse(ref_scores: torch.Tensor, trial_scores: torch.Tensor, diff: torch.Tensor | None = None,
               ref_argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """KL(softmax(ref) || softmax(trial)) over the last dim, per row / position, in float64, and, when
    ``ref_argmax`` (index of each row's maximum) is given, both log-sum-exps at no extra pass over the scores.

    Cancellation-free for small divergences: with d = trial - ref and p = softmax(ref),
    KL = log(sum p e^d) - sum p d = C - (A - log1p(A)), where C = sum p (expm1(d) - d) is a sum of
    non-negative terms (~p d^2 / 2) and A = sum p expm1(d): no two large numbers are subtracted (the
    textbook difference of two log-sum-exps of size ~log C loses everything below 1e-6 in float32).
    Non-finite trials give inf.

    Log-sum-exps: lse(ref) = ref_max - log(p_max) (p_max >= 1/C: its log is accurate) and
    lse(trial) = lse(ref) + log1p(A), since sum p e^d = sum e^(trial - lse(ref)); rows far apart (where KL
    is taken directly) take their own ``logsumexp``. Float64, accurate to float32 rounding of the scores.
    """
    r = ref_scores.detach()
    t = trial_scores.detach()
    if r.dtype not in (torch.float32, torch.float64):
        r, t = r.float(), t.float()
    t = t.to(r.dtype)
    if r.numel() == 0:
        empty = torch.zeros(r.shape[:-1], dtype=torch.float64)
        return empty, (empty.clone() if ref_argmax is not None else None), (empty.clone() if ref_argmax is not None else None)
    d = torch.sub(t, r) if diff is None else diff
    p = torch.softmax(r, dim=-1)
    e = torch.expm1(d)
    a = torch.mul(p, e).sum(-1).double()  # a product and a sum: 6x faster than bmm of [n, 1, C] x [n, C, 1] on a CPU
    e.sub_(d)
    pos = e.mul_(p).sum(-1).double()
    kl = pos - (a - torch.log1p(a))
    lse_ref = lse_trial = None
    if ref_argmax is not None:
        index = ref_argmax.unsqueeze(-1)
        lse_ref = r.gather(-1, index).squeeze(-1).double() - torch.log(p.gather(-1, index).squeeze(-1).double())
        lse_trial = lse_ref + torch.log1p(a)
    large = ~torch.isfinite(kl) | (a > 1.0)  # far apart: the direct form has no cancellation to fear
    if bool(large.any()):
        rl, tl, pl = r[large].double(), t[large].double(), p[large].double()
        lse_r = torch.logsumexp(rl, dim=-1)
        lse_t = torch.logsumexp(tl, dim=-1)
        # Over the support of p only: a class the reference rules out (-inf logit, a masked vocabulary)
        # adds nothing, where the pieces above would give 0 * inf = NaN for identical outputs.
        direct = lse_t - lse_r - torch.where(pl > 0, pl * (tl - rl), torch.zeros_like(pl)).sum(-1)
        kl[large] = torch.where(torch.isfinite(direct), direct, torch.full_like(direct, math.inf))
        if lse_trial is not None:
            lse_trial[large] = lse_t
    return kl.clamp_(min=0.0), lse_ref, lse_trial


class DecisionStats:
    """Decisions of reference and trial compared, per case ([N, C]) or per token ([N, T, C]), slice by slice.

    Flips are counted in three exact groups:
    - ``boundary_flips`` among the constructed boundary cases (kind ``boundary``), limited as a fraction;
    - ``near_boundary_flips`` among REAL cases (ordinary, edge) whose reference margin, in the unit
      ``margin_kind``, is below ``boundary_margin``: limited apart, never silently allowed;
    - ``flips`` among real cases farther from the boundary.
    Per-token outputs also give the distribution agreement: KL(reference || trial) per token (mean,
    p99, max), top-1 agreement and top-k overlap. Tokens whose target is -100 are ignored.
    ``flip_list`` holds every flipped case (per token: at most ``max_listed`` tokens, the count stays exact).
    Per-case summaries (``per_case``) are kept for every case: a few numbers each.
    """

    def __init__(self, ids: Sequence[str], kinds: Sequence[str], tie_rule: str, boundary_margin: float, margin_kind: str,
                 capacity_tokens: int, top_k: int = 5, max_listed: int = 10_000) -> None:
        self.ids, self.kinds = ids, kinds
        self.tie_rule, self.boundary_margin, self.margin_kind = tie_rule, boundary_margin, margin_kind
        self.top_k, self.max_listed = top_k, max_listed
        self.counts = {"cases": 0, "boundary_cases": 0, "near_boundary_cases": 0, "flips": 0, "near_boundary_flips": 0, "boundary_flips": 0}
        self.flip_list: list[dict] = []
        self.listed_dropped = 0
        self.per_token = False
        self.tokens = 0
        self.top1_agree = 0
        self.overlap_sum = 0.0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.kl_q = StreamQuantile(0.99, max(capacity_tokens, 1))
        self.constructed = torch.tensor([k == "boundary" for k in kinds], dtype=torch.bool)
        n = len(ids)
        self._case = {
            "flips": torch.zeros(n, dtype=torch.int64),
            "margin": torch.full((n,), math.inf, dtype=torch.float64),
            "reference_class": torch.full((n,), -3, dtype=torch.int64),
            "trial_class": torch.full((n,), -3, dtype=torch.int64),
            "kl_sum": torch.zeros(n, dtype=torch.float64),
            "tokens": torch.zeros(n, dtype=torch.int64),
            "kl_max": torch.zeros(n, dtype=torch.float64),
            "worst_token": torch.zeros(n, dtype=torch.int64),
        }

    def update(self, row: int, ref: torch.Tensor, trial: torch.Tensor, targets: torch.Tensor | None = None,
               position: int = 0, diff: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Cases ``row:row + len(ref)`` (positions ``position:position + T'`` for [n, T', C] scores).

        Returns the decisions of both sides ({"reference": labels, "trial": labels}) for reuse."""
        n = ref.shape[0]
        per_token = ref.ndim == 3
        self.per_token = per_token
        need_lse = self.margin_kind == "probability"
        k = min(max(self.top_k, 2), ref.shape[-1]) if per_token else 2
        r_lab, r_top, r_lse = _top(ref, k, self.tie_rule, need_lse)
        r_margin = margins(r_top, self.margin_kind, r_lse, ref)
        if per_token:  # top-k overlap needs the trial's k best
            t_lab, t_top, t_lse = _top(trial, k, self.tie_rule, need_lse)
            t_margin = margins(t_top, self.margin_kind, t_lse, trial)
        else:  # the trial's margin is only reported for flipped cases: computed for them alone, below
            t_lab = labels_of(trial, self.tie_rule)
            t_margin = None
        rows = slice(row, row + n)
        constructed = self.constructed[rows]
        if per_token:
            valid = (targets != IGNORE_INDEX) if targets is not None else torch.ones(r_lab.shape, dtype=torch.bool)
            constructed_pos = constructed[:, None].expand_as(r_lab)
        else:
            valid = torch.ones(n, dtype=torch.bool)
            constructed_pos = constructed
        flipped = ((r_lab != t_lab) | _ties_differ(ref, trial, r_lab, t_lab)) & valid
        near = (r_margin < self.boundary_margin) & valid & ~constructed_pos  # NaN margins are never "near"
        c = self.counts
        c["cases"] += int(valid.sum())
        c["boundary_cases"] += int((constructed_pos & valid).sum())
        c["near_boundary_cases"] += int(near.sum())
        c["boundary_flips"] += int((flipped & constructed_pos).sum())
        c["near_boundary_flips"] += int((flipped & near).sum())
        c["flips"] += int((flipped & ~constructed_pos & ~near).sum())
        case = self._case
        if not per_token:
            case["flips"][rows] = flipped.long()
            case["margin"][rows] = r_margin
            case["reference_class"][rows] = r_lab
            case["trial_class"][rows] = t_lab
            where = torch.nonzero(flipped).flatten()
            if where.numel():
                t_sub = trial[where]
                _, top_sub, lse_sub = _top(t_sub, 2, self.tie_rule, need_lse)
                t_margin = margins(top_sub, self.margin_kind, lse_sub, t_sub)
            for j, i in enumerate(where.tolist()):
                self.flip_list.append(self._record(row + i, None, bool(near[i]), int(r_lab[i]), int(t_lab[i]),
                                                   float(r_margin[i]), float(t_margin[j]), ref[i], trial[i]))
            return {"reference": r_lab, "trial": t_lab}
        kl, lse_r, lse_t = kl_and_lse(ref, trial, diff, ref_argmax=r_top[1][..., 0])
        kl_v = kl[valid]
        self.tokens += kl_v.numel()
        self.kl_sum += float(kl_v.sum())
        self.kl_max = max(self.kl_max, float(kl_v.max()) if kl_v.numel() else 0.0)
        self.kl_q.update(kl_v)
        self.top1_agree += int((~flipped & valid).sum())
        ov = (r_top[1][..., :, None] == t_top[1][..., None, :]).any(-1).sum(-1).double() / k
        self.overlap_sum += float(ov[valid].sum())
        if kl.shape[1]:
            kl_masked = torch.where(valid, kl, torch.zeros_like(kl))
            case["flips"][rows] += flipped.sum(1)
            case["kl_sum"][rows] += kl_masked.sum(1)
            case["tokens"][rows] += valid.sum(1)
            block_max, block_arg = kl_masked.max(1)
            better = block_max > case["kl_max"][rows]
            case["worst_token"][rows] = torch.where(better, block_arg + position, case["worst_token"][rows])
            case["kl_max"][rows] = torch.maximum(block_max, case["kl_max"][rows])
            m = torch.where(valid, r_margin, torch.full_like(r_margin, math.inf)).min(1).values
            case["margin"][rows] = torch.minimum(case["margin"][rows], m)
        where = torch.nonzero(flipped)
        room = self.max_listed - len(self.flip_list)
        if where.shape[0] > room:
            self.listed_dropped += where.shape[0] - max(room, 0)
            where = where[: max(room, 0)]
        for i, j in where.tolist():
            rec = self._record(row + i, position + j, bool(near[i, j]), int(r_lab[i, j]), int(t_lab[i, j]), float(r_margin[i, j]),
                               float(t_margin[i, j]), ref[i, j], trial[i, j])
            rec["kl"] = float(kl[i, j])
            self.flip_list.append(rec)
        return {"reference": r_lab, "trial": t_lab, "lse_reference": lse_r, "lse_trial": lse_t}

    def _record(self, case: int, position, near, rc, tc, rm, tm, r_scores, t_scores) -> dict:
        rec = {"id": self.ids[case], "kind": self.kinds[case], "boundary": bool(self.constructed[case]), "near_boundary": near,
               "reference_class": rc, "trial_class": tc, "reference_margin": rm, "trial_margin": tm, "margin_kind": self.margin_kind}
        if position is not None:
            rec["position"] = position
        if r_scores.numel() <= 16:
            rec["reference_scores"] = r_scores.double().tolist()
            rec["trial_scores"] = t_scores.double().tolist()
        else:  # a vocabulary: the top 5 of each side
            for side, s in (("reference", r_scores), ("trial", t_scores)):
                v, i = s.float().topk(5)
                rec[f"{side}_top"] = [[a, b] for a, b in zip(i.tolist(), v.double().tolist())]
        return rec

    def per_case(self) -> dict[str, torch.Tensor]:
        """Per case, in case order: flips (per token: flipped tokens), the reference margin (per token: the
        smallest), reference and trial class (per case) or KL mean, KL max and the worst token (per token)."""
        c = self._case
        if not self.per_token:
            return {k: c[k] for k in ("flips", "margin", "reference_class", "trial_class")}
        return {"flips": c["flips"], "margin": c["margin"], "kl_mean": c["kl_sum"] / c["tokens"].clamp(min=1),
                "kl_max": c["kl_max"], "worst_token": c["worst_token"]}

    def result(self) -> dict:
        c = dict(self.counts)
        return {
            **c,
            "unit": "token" if self.per_token else "case",
            "margin_kind": self.margin_kind,
            "boundary_margin": self.boundary_margin,
            "boundary_flip_fraction": c["boundary_flips"] / c["boundary_cases"] if c["boundary_cases"] else 0.0,
            "real_flips": c["flips"] + c["near_boundary_flips"],
            "flip_list": self.flip_list,
            "flip_list_dropped": self.listed_dropped,
        }

    def distribution(self) -> dict | None:
        """Distribution agreement of per-token outputs (None for per-case classification)."""
        if not self.per_token:
            return None
        n = self.tokens
        return {
            "tokens": n,
            "kl_mean": self.kl_sum / n if n else 0.0,
            "kl_p99": self.kl_q.result(),
            "kl_p99_upper": self.kl_q.upper(),  # never below the exact value: what a gate reads
            "kl_p99_exact": self.kl_q.exact,
            "kl_max": self.kl_max,
            "top1_agreement": self.top1_agree / n if n else 1.0,
            "top_k": self.top_k,
            "top_k_overlap": self.overlap_sum / n if n else 1.0,
        }


def classification_flips(
    ids: Sequence[str],
    kinds: Sequence[str],
    ref_scores: torch.Tensor,
    trial_scores: torch.Tensor,
    tie_rule: str,
    boundary_margin: float,
    margin_kind: str = "logit",
    targets: torch.Tensor | None = None,
) -> dict:
    """``DecisionStats`` over one pair of score tensors (see there)."""
    acc = DecisionStats(ids, kinds, tie_rule, boundary_margin, margin_kind, capacity_tokens=ref_scores[..., 0].numel())
    acc.update(0, ref_scores, trial_scores, targets)
    out = acc.result()
    dist = acc.distribution()
    if dist is not None:
        out["distribution"] = dist
    return out


def regression_flips(
    ids: Sequence[str], kinds: Sequence[str], ref: torch.Tensor, trial: torch.Tensor, threshold: float | None
) -> dict:
    """Cases whose first output crosses the decision threshold between reference and trial."""
    flips = []
    if threshold is not None and ref.shape[0]:
        r = ref.detach().double().reshape(ref.shape[0], -1)[:, 0]
        t = trial.detach().double().reshape(trial.shape[0], -1)[:, 0]
        crossed = (r >= threshold) != (t >= threshold)
        for i in torch.nonzero(crossed).flatten().tolist():
            flips.append({"id": ids[i], "kind": kinds[i], "boundary": False, "near_boundary": False, "reference": float(r[i]), "trial": float(t[i])})
    return {"cases": len(ids), "boundary_cases": 0, "near_boundary_cases": 0, "flips": len(flips), "near_boundary_flips": 0, "boundary_flips": 0,
            "boundary_flip_fraction": 0.0, "real_flips": len(flips), "unit": "case", "flip_list": flips, "flip_list_dropped": 0}


# ----------------------------------------------------------------------------------------------------
# Quality


BUILTIN_METRICS = ("accuracy", "top_k", "neg_rmse", "neg_mae")


class QualityStats:
    """Quality of one set of outputs on the cases with a target, accumulated chunk by chunk.

    ``metric``: ``accuracy`` (per token: token accuracy over targets != -100), ``top_k`` (target among
    the k best scores), ``neg_rmse``, ``neg_mae`` (regression, over every output value). Per-token
    classification also gives the perplexity exp(mean token NLL) (a language model's). A user metric
    (``module:function``) is not streamed: ``QualityStats`` then keeps the target rows and calls it once
    (per-token scores as tokens: ``f(scores [M, C], targets [M])``, -100 targets included).
    """

    def __init__(self, metric: str, tie_rule: str, top_k: int = 5, user: Callable | None = None) -> None:
        self.metric, self.tie_rule, self.top_k, self.user = metric, tie_rule, top_k, user
        self.n = 0
        self.total = 0.0
        self.nll = 0.0
        self.per_token = False
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor | None = None,
               lse: torch.Tensor | None = None) -> torch.Tensor | None:
        """``outputs`` and ``targets`` of the cases WITH a target only; ``labels``: their decisions, ``lse``: the
        log-sum-exp of each position's scores (per token), when known. Returns the hit mask (accuracy, top_k:
        what the paired counts of two sides are taken from), else None."""
        if outputs.shape[0] == 0:
            return None
        if self.user is not None:  # per token, as tokens [M, C] and [M] (slices of a sequence may differ in length)
            o, y = outputs.detach(), targets.detach()
            if o.ndim == 3:
                o, y = o.reshape(-1, o.shape[-1]), y.reshape(-1)
            self._kept.append((o.clone(), y.clone()))
            return None
        if self.metric in ("accuracy", "top_k"):
            s = outputs.detach()
            self.per_token = s.ndim == 3
            y = targets.long()
            valid = y != IGNORE_INDEX
            if bool(((y < 0) & valid).any() or (y >= s.shape[-1]).any()):
                bad = y[valid & ((y < 0) | (y >= s.shape[-1]))]
                raise UserError(
                    f"task.data: an eval target is {int(bad[0])} but the model scores {s.shape[-1]} classes; give targets in "
                    f"0..{s.shape[-1] - 1} (or -100 to ignore a position), then `dvc repro`"
                )
            if self.metric == "accuracy":
                if labels is None:
                    labels = labels_of(s, self.tie_rule)
                hit = labels == y
            else:
                idx = s.float().topk(min(self.top_k, s.shape[-1]), dim=-1).indices
                hit = (idx == y.unsqueeze(-1)).any(-1)
            hit = hit & torch.isfinite(s).all(-1) & valid  # a row with any non-finite score is a miss, whatever the metric
            self.total += float(hit.sum())
            self.n += int(valid.sum())
            if self.per_token:
                sf = s if s.dtype in (torch.float32, torch.float64) else s.float()
                index = y.clamp(min=0).unsqueeze(-1)
                if lse is not None:  # known (``kl_and_lse``): only the target's score is read
                    nll = lse.double() - sf.gather(-1, index).squeeze(-1).double()
                else:  # max-shifted, accurate in float32; log_softmax is one fused pass (logsumexp takes two)
                    nll = -torch.log_softmax(sf, dim=-1).gather(-1, index).squeeze(-1).double()
                self.nll += float(torch.where(valid, nll, torch.zeros_like(nll)).sum(dtype=torch.float64))
            return hit
        else:
            p = outputs.detach().double().reshape(-1)
            y = targets.detach().double().reshape(-1)
            if p.numel() != y.numel():
                p = outputs.detach().double().reshape(outputs.shape[0], -1)[:, 0]
                y = targets.detach().double().reshape(targets.shape[0], -1)[:, 0]
            err = p - y
            self.total += float(err.pow(2).sum() if self.metric == "neg_rmse" else err.abs().sum())
            self.n += err.numel()
        return None

    def result(self) -> float:
        if self.user is not None:
            if not self._kept:
                return math.nan
            value = self.user(torch.cat([o for o, _ in self._kept]), torch.cat([t for _, t in self._kept]))
            if isinstance(value, bool) or not (isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1)):
                raise UserError(f"task.metric returned {type(value).__name__} {getattr(value, 'shape', '')}; return one number")
            return float(value)
        if self.n == 0:
            return math.nan
        if self.metric in ("accuracy", "top_k"):
            return self.total / self.n
        if self.metric == "neg_rmse":
            return -math.sqrt(self.total / self.n)
        return -self.total / self.n

    def counts(self) -> tuple[int, int] | None:
        """(hits, targets) of ``accuracy`` / ``top_k`` (the quality criteria compare counts, not rounded fractions);
        None for other metrics."""
        if self.user is not None or self.metric not in ("accuracy", "top_k"):
            return None
        return int(self.total), self.n

    def perplexity(self) -> float | None:
        """exp(mean NLL per target token), for per-token classification scored by accuracy or top_k."""
        if not self.per_token or self.n == 0:
            return None
        return math.exp(self.nll / self.n) if self.nll / self.n < 700 else math.inf


def accuracy(scores: torch.Tensor, targets: torch.Tensor, tie_rule: str) -> float:
    acc = QualityStats("accuracy", tie_rule)
    acc.update(scores, targets)
    return acc.result()


def regression_errors(pred: torch.Tensor, targets: torch.Tensor, extreme_quantile: float = 0.1) -> dict:
    """MAE, RMSE, max error, and the error on the most extreme targets (top and bottom quantile)."""
    p = pred.detach().double().reshape(pred.shape[0], -1)[:, 0]
    y = targets.detach().double().reshape(targets.shape[0], -1)[:, 0]
    if y.numel() == 0:
        return {"mae": math.nan, "rmse": math.nan, "max_error": math.nan, "extreme_low_mae": math.nan, "extreme_high_mae": math.nan}
    err = (p - y).abs()
    k = max(1, int(math.ceil(extreme_quantile * y.numel())))
    order = y.argsort(stable=True)
    return {
        "mae": float(err.mean()),
        "rmse": float(err.pow(2).mean().sqrt()),
        "max_error": float(err.max()),
        "extreme_low_mae": float(err[order[:k]].mean()),
        "extreme_high_mae": float(err[order[-k:]].mean()),
        "output_min": float(p.min()),
        "output_max": float(p.max()),
    }


def quality(kind: str, outputs: torch.Tensor, targets: torch.Tensor, tie_rule: str, metric: str | None = None, top_k: int = 5) -> float:
    """One number of the quality metric (default: accuracy for classification, minus the RMSE for regression)."""
    acc = QualityStats(metric or ("accuracy" if kind == "classification" else "neg_rmse"), tie_rule, top_k)
    acc.update(outputs, targets)
    return acc.result()


# ----------------------------------------------------------------------------------------------------
# Training


def trajectory_gap(
    ref_loss: Sequence[float],
    trial_loss: Sequence[float],
    atol: float,
    rtol: float,
    replicate_loss: Sequence[float] | None = None,
    noise_multiple: float | None = None,
    noise_atol: float | None = None,
) -> dict:
    """Per-step loss band |trial - ref| <= atol + rtol * |ref|; non-finite trial losses violate it.

    With a replicate trajectory (FP32 again under a harmless change of the data order: FP32's own run-to-run
    variation), also the noise floor: per step the replicate's gap beside AMP's, and, when ``noise_multiple``
    is set, the band on the curves: AMP's mean gap and its largest gap each at most ``noise_multiple`` times
    the replicate's, plus ``noise_atol``.
    """
    if len(ref_loss) != len(trial_loss):
        raise ValueError(f"trajectories differ in length: {len(ref_loss)} vs {len(trial_loss)}")
    r = torch.tensor([float(v) for v in ref_loss], dtype=torch.float64)
    t = torch.tensor([float(v) for v in trial_loss], dtype=torch.float64)
    # A non-finite loss on EITHER side is outside any band: a NaN reference step must not pass by comparison.
    gap = torch.where(torch.isfinite(t) & torch.isfinite(r), (t - r).abs(), torch.full_like(t, math.inf))
    bad = ~(gap - (atol + rtol * r.abs()) <= 0)  # NaN (a non-finite reference step) is outside the band too
    violations = int(bad.sum())
    first = int(torch.nonzero(bad).flatten()[0]) if violations else -1
    worst_step = int(gap.argmax()) if gap.numel() else -1
    out = {
        "steps": len(ref_loss),
        "band_violations": violations,
        "first_violation_step": first,
        "max_loss_gap": float(gap[worst_step]) if gap.numel() else 0.0,
        "max_loss_gap_step": worst_step,
        "final_loss_reference": float(r[-1]) if r.numel() else math.nan,
        "final_loss_trial": float(t[-1]) if t.numel() else math.nan,
    }
    if replicate_loss is not None:
        if len(replicate_loss) != len(ref_loss):
            raise ValueError(f"replicate trajectory has {len(replicate_loss)} steps, the reference {len(ref_loss)}")
        rep = torch.tensor([float(v) for v in replicate_loss], dtype=torch.float64)
        noise = torch.where(torch.isfinite(rep), (rep - r).abs(), torch.full_like(rep, math.inf))
        noise_out = {
            "replicate_gap": noise.tolist(),
            "amp_gap": gap.tolist(),
            "max_replicate_gap": float(noise.max()) if noise.numel() else 0.0,
            "mean_replicate_gap": float(noise.mean()) if noise.numel() else 0.0,
            "mean_amp_gap": float(gap.mean()) if gap.numel() else 0.0,
            "max_amp_gap": float(gap.max()) if gap.numel() else 0.0,
            "multiple": noise_multiple,
            "atol": noise_atol,
            "violations": 0,
            "first_violation_step": -1,
            "worst_ratio": 0.0,
        }
        # Curve-level, as Megatron gates on loss-curve area: one replicate's per-step gap crosses zero by chance,
        # so the band compares the curves' mean gap (area) and their largest gap, not step by step.
        m_amp, m_rep = noise_out["mean_amp_gap"], noise_out["mean_replicate_gap"]
        noise_out["mean_ratio"] = m_amp / m_rep if m_rep > 0 else (math.inf if m_amp > 0 else 0.0)
        noise_out["worst_ratio"] = noise_out["mean_ratio"]
        if noise_multiple is not None or noise_atol is not None:
            k, a = noise_multiple or 0.0, noise_atol or 0.0
            over_mean = not m_amp <= k * m_rep + a
            over_max = not noise_out["max_amp_gap"] <= k * noise_out["max_replicate_gap"] + a
            noise_out["violations"] = int(over_mean) + int(over_max)
            noise_out["over"] = [name for name, bad in (("mean", over_mean), ("max", over_max)) if bad]
            noise_out["first_violation_step"] = int(gap.argmax()) if noise_out["violations"] else -1
        out["noise"] = noise_out
    return out


def update_health(skipped: Sequence[bool], scales: Sequence[float], nonfinite_loss: Sequence[bool], window: int,
                  nonfinite_grad: Sequence[bool] | None = None) -> dict:
    """Skipped fraction, whether real updates stopped in the last ``window`` steps, final scale, and the steps
    whose gradient norm was not finite WITHOUT a GradScaler to skip them (bfloat16, FP32): not applied, listed."""
    n = len(skipped)
    window = min(window, n)  # a run shorter than the window stalls when none of its steps made a real update
    tail = list(skipped[-window:]) if n else []
    first_nonfinite = next((i for i, bad in enumerate(nonfinite_loss) if bad), -1)
    bad_grads = [i for i, bad in enumerate(nonfinite_grad or []) if bad]
    return {
        "nonfinite_grad_steps": bad_grads,
        "skipped_steps": int(sum(skipped)),
        "skipped_fraction": sum(skipped) / n if n else 0.0,
        "real_updates": n - int(sum(skipped)),
        "stalled": bool(n and all(tail)),
        "stall_window": window,
        "final_scale": scales[-1] if scales else 1.0,
        "min_scale": min(scales) if scales else 1.0,
        "first_nonfinite_loss_step": first_nonfinite,
    }

