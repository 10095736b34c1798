"""Quantiles of the comparison: nearest rank, exact for a tensor in memory, bounded for a stream.

``quantile`` (exact nearest rank, via ``kthvalue``, no sort) for a tensor in memory; ``StreamQuantile``
for a stream: exact while the largest (1 - q) share of the stream fits in ``MAX_EXACT`` values (p99 of up
to 6.5e6 values: it keeps only those, merged with numpy's partition), else a histogram of the float32 bit
patterns (exponent and top 10 mantissa bits, one ``bincount`` per slice) whose answer is within a relative
error ``SKETCH_ALPHA`` = 2**-11 of the exact nearest-rank value and never above the exact maximum. Either
way the answer does not depend on the chunking.
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import torch

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
KEEP_SHARE_FILTERED = 0.1
"""Past the cut, an update whose predecessor kept more than this share of its values keys every value (one shift,
one ``bincount``: ~2.3 ms per 1e6 on one CPU thread) instead of selecting the kept ones first (~0.5 ms at 1 %, ~7 ms
at half: the selection's branches mispredict); both count exactly the values at or above the cut."""
_KEY_FLOOR = (127 - 40) << (23 - HIST_SHIFT)  # key of HIST_FLOOR: smaller values share bucket 0
_KEY_INF = 0x7F800000 >> HIST_SHIFT  # key of +inf, the largest


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

    def __init__(self, q: float, capacity: int, max_exact: int = MAX_EXACT) -> None:
        if not 0.5 <= q <= 1.0:
            raise ValueError(f"StreamQuantile keeps the largest values: q must be in [0.5, 1], got {q}")
        self.q, self.n = q, 0
        self.keep = int(math.floor((1.0 - q) * capacity)) + 2
        self.exact = self.keep <= max_exact
        self._parts: list[torch.Tensor] = []
        self._held = 0
        self._floor = -math.inf
        self._max = -math.inf
        self._negatives: list[torch.Tensor] = []
        self._hist = None if self.exact else torch.zeros(_KEY_INF - _KEY_FLOOR + 1, dtype=torch.int64)
        self._cut = 0
        """Histogram buckets below this one are no longer counted: those at or above it hold ``keep`` values
        already, so the answer's bucket is never below it (counts above a bucket never change by dropping
        values below it): the same answer, and most values of a long stream skip the ``bincount``."""
        self._cut_value = 0.0
        self._kept_share = 1.0
        """Share of the last update's values at or above the cut: it picks how the next one is counted (the same counts)."""
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
                v = values_above(v, self._floor)
            self._keep(v.clone() if v.device.type == "cpu" and v.data_ptr() == values.data_ptr() else v)
            return
        if v.dtype != torch.float32:
            v = v.float()  # float64 (KL) rounded to float32: 2**-24 relative, far below the bucket width
        if self._cut:  # negatives are below the cut too
            top = float(v.amax()) if vmax is None else float(vmax)
            self._max = max(self._max, top)
            if top < self._cut_value:
                return
            if self._kept_share > KEEP_SHARE_FILTERED:  # most values still pass: key every one, those below in a junk bucket
                below = _KEY_FLOOR + self._cut - 1
                key = _keys(v)
                counts = torch.bincount(key.clamp_(min=below).sub_(below))[1:]
                self._kept_share = float(counts.sum()) / v.numel()
            else:  # few pass: select them first (a compaction costs less than keying every value)
                n = v.numel()
                v = values_above(v, self._cut_value, inclusive=True)
                self._kept_share = v.numel() / n
                key = _keys(v)
                counts = torch.bincount(key.sub_(_KEY_FLOOR + self._cut))
            self._hist[self._cut : self._cut + counts.numel()] += counts.to(self._hist.device)
            self._raise_cut()
            return
        if not nonneg and float(v.min()) < 0:
            negative = v < 0
            self._negatives.append(v[negative].double().cpu())
            v = v[~negative]
            if v.numel() == 0:
                return
        self._max = max(self._max, float(v.amax()) if vmax is None else float(vmax))
        key = _keys(v)  # >= 0: the order of the values
        counts = torch.bincount(key.clamp_(min=_KEY_FLOOR).sub_(_KEY_FLOOR))
        self._hist[: counts.numel()] += counts.to(self._hist.device)
        self._raise_cut()

    def selection(self) -> tuple[float, bool]:
        """Which of the next values an update still needs: those above the value returned (at or above it where the
        flag says so); -inf: every one. A kernel selects them while it computes them (``update_selected``)."""
        if self.exact:
            return self._floor, False
        return (self._cut_value, True) if self._cut else (-math.inf, True)

    def update_selected(self, selected: torch.Tensor, n: int, vmax: float) -> None:
        """``update`` with ``n`` finite values >= 0 whose maximum is ``vmax``, given only those ``selection`` names
        (float32, on the CPU, in their order): the same state after it as ``update`` of all of them."""
        self.n += n
        if n == 0 or (self.exact and vmax <= self._floor):
            return
        if self.exact:
            self._keep(selected.clone())  # never a view of the caller's buffer
            return
        self._max = max(self._max, vmax)
        if self._cut and vmax < self._cut_value:
            return
        below = _KEY_FLOOR + self._cut
        counts = torch.bincount(_keys(selected).clamp_(min=below).sub_(below))
        self._hist[self._cut : self._cut + counts.numel()] += counts
        if self._cut:
            self._kept_share = selected.numel() / n
        self._raise_cut()

    def _keep(self, v: torch.Tensor) -> None:
        """Exact: keep ``v`` (values above the floor, owned), merging once enough are held."""
        if v.numel():  # kept on the CPU (numpy partitions them)
            self._parts.append(v.cpu())
            self._held += v.numel()
        if self._held > 2 * self.keep + SLACK:
            self._shrink()

    def _raise_cut(self) -> None:
        """Move the cut up to the highest bucket with at least ``keep`` values at or above it (see ``_cut``)."""
        end = min(max(_key_of(self._max) - _KEY_FLOOR, 0), self._hist.numel() - 1) + 1  # past the highest bucket used
        top = torch.flip(self._hist[self._cut : end], [0]).cumsum(0)  # values at or above each bucket, from the top down
        if top.numel() == 0 or int(top[-1]) < self.keep:
            return
        cut = end - 1 - int(torch.searchsorted(top, self.keep))
        if cut > self._cut:
            self._cut, self._cut_value = cut, _from_bits((cut + _KEY_FLOOR) << HIST_SHIFT)

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
        key = _key_of(estimate)
        return min(_from_bits((key + 1) << HIST_SHIFT), self._max)


def values_above(v: torch.Tensor, floor: float, inclusive: bool = False) -> torch.Tensor:
    """The values of 1-D ``v`` above ``floor`` (at or above it if ``inclusive``), in their order: through numpy
    on the CPU (its comparison is several times faster than torch's there)."""
    if v.device.type == "cpu":
        a = v.numpy()
        return torch.from_numpy(a[a >= floor] if inclusive else a[a > floor])
    return v[v >= floor] if inclusive else v[v > floor]


def _keys(v: torch.Tensor) -> torch.Tensor:
    """The histogram keys of float32 values (``HIST_SHIFT``): their bit patterns shifted, in the values' order for
    values >= 0."""
    return torch.bitwise_right_shift(v.contiguous().view(torch.int32), HIST_SHIFT)


def _key_of(x: float) -> int:
    """The histogram key of a float32 value >= 0 (``HIST_SHIFT``)."""
    return struct.unpack("<i", struct.pack("<f", x))[0] >> HIST_SHIFT


def _from_bits(bits: int) -> float:
    """The float32 whose bit pattern is ``bits``."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]

