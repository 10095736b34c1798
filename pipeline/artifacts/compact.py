"""The compact store of per-token scores: 2 bytes per vocabulary entry, decisions and top-k exact, every other error bounded.

A language model's outputs are float32 scores [N, T, V]: 4 bytes per entry, tens of GB per source at 7B scale.
Per token (one row of V scores, z), the compact store keeps (llama.cpp's idea, changed where it loses exactness):

- ``codes`` (uint16 bits, stored as int16): 65535 is exactly the row's largest finite score ``top`` (every tie
  of the maximum is exact); 0, 1, 2 are -inf, NaN and +inf (exact: masked vocabularies and overflows survive);
  3..65534 are ``top - j * step``, j = 65534 - code in [0, 65531], the nearest of 65,532 levels spanning the
  row's finite range (no window: nothing is clamped, however flat or peaked the row is);
- ``top``, ``step`` (float32, ``step`` rounded up so that the range fits), and ``second`` (the largest finite
  score below ``top``, exact) with ``second_index`` (its first index; -1 when none);
- ``best``, ``best_index`` [K]: the row's K best finite scores and their classes, exact, in the order top-k reads
  them (score descending, equal scores by lowest index; -1 past the row's finite scores), K = ``task.top_k``;
- ``lse`` and ``spread`` (float64): the row's log-sum-exp and live spread (``row_lse``, ``row_spread``) of the original
  scores, what the probability and the relative margins read beside the exact top two (issue 50.2: decoded, a row's
  log-sum-exp moves by up to half a step, and a margin that close to ``boundary_margin`` changed sides).

Decoded linear entries are clamped at ``second``, and below the K-th best (strictly below it at a lower index: a class
outside the K best stays behind it in that order), then ``second`` and the K best are written back at their indices.
Each clamp is a bound the original score obeys, so it only brings a decoded value nearer. Decoded, a row therefore has
exactly the original maximum, its ties, its first index and the exact top-2 gap (labels, both tie rules, flips, the
logit margin; with ``lse`` and ``spread``, the probability and relative margins), the exact rank of every class
among the K best (``top_k`` for any k <= K: a target within half a quantum of its neighbour was re-ranked by the codes
alone, issue 50.2), and every other finite entry within ``logit_error`` = step / 2 + float32 rounding of the decoded
value.

KL(reference || trial) reads both sides' every score together, which no statistic of one side keeps: decoded, it moves by
up to ``compare.decisions.kl_bound``. So a trial's compacted output also keeps ``kl`` (float64 [n, T], part ``KL``): each
token's KL against the reference's full scores, ``compare.decisions.token_kl``'s numbers, which compare computes of the
same full scores under ``store: full`` (the same bits in any block, on the same machine's CPU); compare reads them in
place of the decoded scores', and the KL gates decide as under ``full``. A trial of a reference stored compact keeps none
(nothing exact to measure against): its KL gates add the store's bound. Only float32 outputs of shape
[N, T, V >= 2] of a classification are compacted (``chosen``): float16 and bfloat16 already take 2 bytes, exactly,
and a regression's values are decided at a threshold (``label_accuracy``, flips) and scored by their errors, which no
code of 2 bytes keeps exactly near the threshold.

``VERSION`` is recorded in the file's metadata (``compact_version``); a file of another format is refused.
Torch-free (numpy): the report stage reads it without torch; ``outputs`` converts at its edges.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

STORES = ("full", "compact", "auto")
Store = Literal["full", "compact", "auto"]
AUTO_BYTES = 1 << 30
"""``auto`` compacts a source whose per-token float32 scores exceed 1 GiB: below, the full store costs little disk
and read time and its numbers are exact; above (the issue's 32k x 64 x 512 case is 4.2 GB per source, four
sources per comparison), the compact store halves both: every decision exact, KL too where the reference is stored
full (``KL``), else within ``kl_bound`` (about 1e-5 nats on the KL mean of a realistic row)."""
PARTS = ("codes", "top", "step", "second", "second_index", "best", "best_index", "lse", "spread")
KL = "kl"
"""A trial's part beside ``PARTS`` where its reference is stored full: each token's KL(reference || trial), float64."""
VERSION = 4
"""The format: 1 had no ``best`` (top-k re-ranked near ties), 2 no ``lse`` and ``spread`` (probability and relative
margins read from decoded scores), 3 no ``kl`` (the KL gates added the store's bound); files of another version are
refused, to be rebuilt."""
LIVE_NATS = 104.0
"""``compare.gaps.ZERO_PROBABILITY_NATS`` (a class this far below its row's maximum is at probability 0: no live class
of ``row_spread``); repeated here, where torch is never imported (tests/test_compact_verdicts.py holds them equal)."""
KEEP = 5
"""Best classes kept exactly per row when no task says how many (``TaskConfig.top_k``'s default)."""
SEP = "::"
"""Separates an output's name from its part (``logits::codes``): a name a model's output keys never hold."""
LEVELS = 65531
"""Linear steps between the row's minimum and ``top`` (codes 3..65534)."""
TOP, NEG_INF, NAN, POS_INF = 65535, 0, 1, 2
BLOCK_ELEMENTS = 1 << 20
"""Scores encoded or decoded at a time (float64 temporaries of 8 MiB)."""
_ROUNDING = 2.0**-24
"""Relative error of rounding a decoded float64 value to float32 (half an ulp)."""


def compactable(shape: tuple[int, ...], dtype: str) -> bool:
    """Per-token float32 scores [N, T, V >= 2]: what the compact store encodes."""
    return len(shape) == 3 and shape[-1] >= 2 and dtype == "float32"


def chosen(store: str, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
           kind: str = "classification") -> list[str]:
    """The outputs to compact under ``store`` (``shapes`` include dim 0, the number of cases) for a task of ``kind``:
    none of a regression (its values are read at thresholds and by their errors: kept exactly)."""
    names = sorted(n for n in shapes if compactable(shapes[n], dtypes[n]))
    if store == "full" or kind != "classification" or not names:
        return []
    if store == "auto" and sum(4 * int(np.prod(shapes[n])) for n in names) <= AUTO_BYTES:
        return []
    return names


def part(name: str, what: str) -> str:
    return f"{name}{SEP}{what}"


def encode(z: np.ndarray, keep: int = KEEP) -> dict[str, np.ndarray]:
    """The compact parts of float32 scores ``z`` [n, T, V] (``PARTS``), block by block; ``keep``: the best classes kept
    exactly per row (``task.top_k``; at most V)."""
    n, t, v = z.shape
    k = max(1, min(keep, v))
    flat = z.reshape(n * t, v)
    out = {
        "codes": np.empty((n * t, v), dtype=np.uint16), "top": np.empty(n * t, np.float32),
        "step": np.empty(n * t, np.float32), "second": np.empty(n * t, np.float32),
        "second_index": np.empty(n * t, np.int32), "best": np.empty((n * t, k), np.float32),
        "best_index": np.empty((n * t, k), np.int32), "lse": np.empty(n * t, np.float64),
        "spread": np.empty(n * t, np.float64),
    }
    rows = max(1, BLOCK_ELEMENTS // max(v, 1))
    for a in range(0, n * t, rows):
        b = min(a + rows, n * t)
        codes, top, step, second, index, finite = _encode_rows(flat[a:b])
        out["codes"][a:b], out["top"][a:b], out["step"][a:b], out["second"][a:b], out["second_index"][a:b] = (
            codes, top, step, second, index)
        out["best"][a:b], out["best_index"][a:b] = _best(flat[a:b], k, finite)
        out["lse"][a:b], out["spread"][a:b] = _row_stats(flat[a:b])
    shaped = {name: x.reshape(n, t, *x.shape[1:]) for name, x in out.items()}
    shaped["codes"] = shaped["codes"].view(np.int16)  # safetensors has no uint16 here: the same bits
    return shaped


def _encode_rows(z: np.ndarray):
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, or a sum that overflows: the general path
        every_finite = z.size and np.isfinite(z.sum(dtype=np.float64))
    if every_finite:  # every score finite (a sum's one pass): the common rows
        return (*_encode_finite(z), True)
    return (*_encode_general(z), False)


def _encode_general(z: np.ndarray):
    finite = np.isfinite(z)
    any_finite = finite.any(-1)
    top = np.where(any_finite, np.where(finite, z, -np.inf).max(-1), 0).astype(np.float32)
    is_top = (z == top[:, None]) & finite
    below = np.where(finite & ~is_top, z, -np.inf)
    index = below.argmax(-1).astype(np.int32)
    second = np.take_along_axis(below, index[:, None].astype(np.int64), -1)[:, 0].astype(np.float32)
    index = np.where(np.isfinite(second), index, -1).astype(np.int32)
    low = np.where(any_finite, np.where(finite, z, np.inf).min(-1), top).astype(np.float64)
    step = _step(top, low)
    s = step.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(s > 0, np.rint((top.astype(np.float64)[:, None] - z) / s), 0.0)
    j = np.clip(np.nan_to_num(j, nan=0.0, posinf=0.0, neginf=0.0), 0, LEVELS)
    codes = (TOP - 1 - j).astype(np.uint16)
    codes[is_top] = TOP
    codes[z == -np.inf] = NEG_INF
    codes[np.isnan(z)] = NAN
    codes[z == np.inf] = POS_INF
    return codes, top, step, second, index


def _best(z: np.ndarray, k: int, finite: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` best finite scores and their indices, score descending, equal scores by lowest index (the order
    ``quality``'s top_k ranks a target in); -inf and index -1 past the row's finite scores. The k-th best is at least
    the smallest of the maxima of k disjoint groups of columns (k scores of the row), and at least the smallest of
    the first k and of the last k (a row sorted by class, whose groups' maxima lie low): only the scores above the
    largest of the three, a few per row, are sorted (a full partition of each row took 3x the encoding). ``finite``:
    every score is."""
    w = z if finite else np.where(np.isfinite(z), z, np.float32(-np.inf))
    n, v = w.shape
    floor = np.maximum(w[:, : k * (v // k)].reshape(n, k, v // k).max(-1).min(-1),
                       np.maximum(w[:, :k].min(-1), w[:, -k:].min(-1)))
    rows, cols = np.nonzero(w >= floor[:, None])
    values = w[rows, cols]
    order = np.lexsort((cols, -values, rows))  # by row, then score descending, then index
    rows, cols, values = rows[order], cols[order], values[order]
    take = np.searchsorted(rows, np.arange(n))[:, None] + np.arange(k)  # every row has >= k candidates
    best, index = values[take].astype(np.float32), cols[take].astype(np.int32)
    index[best == -np.inf] = -1
    return best, index


def _step(top: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Each row's float32 step: its span (float64) over ``LEVELS``, one float32 up where rounding made it short, so
    that j never exceeds LEVELS."""
    span = top.astype(np.float64) - low
    step = (span / LEVELS).astype(np.float32)
    short = step.astype(np.float64) * LEVELS < span
    return np.where(short, np.nextafter(step, np.float32(np.inf)), step).astype(np.float32)


def _encode_finite(z: np.ndarray):
    """``_encode_rows`` of rows whose scores are all finite: the same codes, bit for bit (the same float64 operations
    in the same order), without the masks non-finite scores need; 2.5x faster (one thread, 32,000-token rows)."""
    rows = np.arange(z.shape[0])
    top = z.max(-1)
    is_top = z == top[:, None]
    below = np.where(is_top, np.float32(-np.inf), z)
    index = below.argmax(-1).astype(np.int32)
    second = below[rows, index]
    index = np.where(np.isfinite(second), index, -1).astype(np.int32)
    low = z.min(-1).astype(np.float64)
    step = _step(top, low)
    s = step.astype(np.float64)[:, None]
    j = np.subtract(top.astype(np.float64)[:, None], z, dtype=np.float64)
    np.divide(j, np.where(s > 0, s, 1.0), out=j)  # a row of equal scores has no step: its j stays 0, as the general path's
    np.rint(j, out=j)
    np.clip(j, 0, LEVELS, out=j)
    np.subtract(TOP - 1, j, out=j)
    codes = j.astype(np.uint16)
    np.putmask(codes, is_top, TOP)
    return codes, top, step, second, index


def decode(parts: dict[str, np.ndarray]) -> np.ndarray:
    """Float32 scores [n, T, V] from the compact parts (``encode``'s, any rows of them)."""
    codes = parts["codes"].view(np.uint16)
    n, t, v = codes.shape
    flat = codes.reshape(n * t, v)
    top, step = parts["top"].reshape(-1), parts["step"].reshape(-1)
    second, index = parts["second"].reshape(-1), parts["second_index"].reshape(-1)
    best = parts["best"].reshape(n * t, parts["best"].shape[-1])
    best_index = parts["best_index"].reshape(n * t, parts["best"].shape[-1])
    kth, kth_index = best[:, -1], best_index[:, -1].astype(np.int64)
    limit = np.minimum(second, np.where(kth_index >= 0, kth, np.float32(np.inf)))  # (index -1: no k-th best)
    behind = np.nextafter(kth, np.float32(-np.inf))
    out = np.empty((n * t, v), dtype=np.float32)
    rows = max(1, BLOCK_ELEMENTS // max(v, 1))
    work = np.empty(rows * v, dtype=np.float64)  # one float64 buffer for every block
    for a in range(0, n * t, rows):
        b = min(a + rows, n * t)
        c = flat[a:b]
        j = work[: c.size].reshape(c.shape)
        np.subtract(TOP - 1, c, out=j, dtype=np.float64)  # j = (TOP - 1) - code, exact
        np.multiply(j, step[a:b, None].astype(np.float64), out=j)
        np.subtract(top[a:b, None].astype(np.float64), j, out=j)
        z = out[a:b]
        np.copyto(z, j, casting="same_kind")  # rounded to float32 once
        np.minimum(z, limit[a:b, None], out=z)
        tied = np.nonzero(z == kth[a:b, None])  # at the k-th best: a lower index falls behind it (a few per row)
        lower = tied[1] < kth_index[a:b][tied[0]]
        z[tied[0][lower], tied[1][lower]] = behind[a:b][tied[0][lower]]
        at_top = np.nonzero(c == TOP)
        z[at_top] = top[a:b][at_top[0]]
        if c.min() <= POS_INF:  # a code of -inf, NaN or +inf in the block (rare)
            z[c == NEG_INF] = -np.inf
            z[c == NAN] = np.nan
            z[c == POS_INF] = np.inf
        has = np.flatnonzero(index[a:b] >= 0)
        z[has, index[a:b][has]] = second[a:b][has]
        kept = np.nonzero(best_index[a:b] >= 0)
        z[kept[0], best_index[a:b][kept]] = best[a:b][kept]
    return out.reshape(n, t, v)


def row_lse(z: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp in float64, the one definition a margin at ``boundary_margin`` is settled by on every path
    and store (``decisions.settled_margins``; the compact store keeps it, ``lse``): max + log(sum(exp(z - max))), the
    sum numpy's pairwise one over the row alone, so a row gives the same bits in any block of rows. A row whose maximum
    is not finite gives it (torch's ``logsumexp``: -inf, +inf, NaN)."""
    x = np.array(z, dtype=np.float64, order="C", ndmin=2)
    return _lse(x, x.max(-1))


def row_spread(z: np.ndarray) -> np.ndarray:
    """Each row's standard deviation (n - 1) over its live classes, those within ``LIVE_NATS`` of its maximum, in
    float64: ``decisions.live_spread``'s definition, computed one way (two passes of numpy's pairwise sum over the row
    alone) so that the relative margin at ``boundary_margin`` is settled alike on every path and store. One live class:
    inf; a maximum that is not finite: NaN."""
    x = np.array(z, dtype=np.float64, order="C", ndmin=2)
    return _spread(x, x.max(-1))


def _row_stats(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``row_lse``, ``row_spread``) of rows ``z``, bit for bit, from one float64 copy (the same operations)."""
    x = np.array(z, dtype=np.float64, order="C", ndmin=2)
    top = x.max(-1)
    spread = _spread(x, top)
    return _lse(x, top), spread


def _lse(x: np.ndarray, top: np.ndarray) -> np.ndarray:
    """``row_lse`` of float64 rows ``x`` (overwritten) whose maxima are ``top``."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        finite = np.isfinite(top)
        np.subtract(x, np.where(finite, top, 0.0)[:, None], out=x)
        np.exp(x, out=x)
        return np.where(finite, top + np.log(x.sum(-1)), top)


def _spread(x: np.ndarray, top: np.ndarray) -> np.ndarray:
    """``row_spread`` of float64 rows ``x`` (left as they are) whose maxima are ``top``."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        live = x >= (top - LIVE_NATS)[:, None]
        every = bool(live.all())  # the common block: no masked class (the same sums without the masks)
        count = live.sum(-1)
        mean = (x if every else np.where(live, x, 0.0)).sum(-1) / np.maximum(count, 1)
        d = np.subtract(x, mean[:, None])
        np.square(d, out=d)
        var = (d if every else np.where(live, d, 0.0)).sum(-1) / np.maximum(count - 1, 1)
        spread = np.where(count > 1, np.sqrt(var), np.inf)
        return np.where(np.isfinite(top), spread, np.nan)


def logit_error(top: np.ndarray, step: np.ndarray) -> float:
    """The largest |decoded - original| of any finite score of these rows: half a step, plus the float32
    rounding of a decoded value (at most ``_ROUNDING`` of its magnitude, |top| + LEVELS * step)."""
    if top.size == 0:
        return 0.0
    s = step.astype(np.float64)
    return float((0.5 * s + _ROUNDING * (np.abs(top.astype(np.float64)) + LEVELS * s)).max())
