"""The compact store of per-token scores: 2 bytes per vocabulary entry, decisions exact, every other error bounded.

A language model's outputs are float32 scores [N, T, V]: 4 bytes per entry, tens of GB per source at 7B scale.
Per token (one row of V scores, z), the compact store keeps (llama.cpp's idea, changed where it loses exactness):

- ``codes`` (uint16 bits, stored as int16): 65535 is exactly the row's largest finite score ``top`` (every tie
  of the maximum is exact); 0, 1, 2 are -inf, NaN and +inf (exact: masked vocabularies and overflows survive);
  3..65534 are ``top - j * step``, j = 65534 - code in [0, 65531], the nearest of 65,532 levels spanning the
  row's finite range (no window: nothing is clamped, however flat or peaked the row is);
- ``top``, ``step`` (float32, ``step`` rounded up so that the range fits), and ``second`` (the largest finite
  score below ``top``, exact) with ``second_index`` (its first index; -1 when none). Decoded linear entries are
  clamped at ``second``, and ``second`` is written back at its index.

Decoded, a row therefore has exactly the original maximum, its ties, its first index and the exact top-2 gap
(labels, both tie rules, flips, the logit margin), and every other finite entry within ``logit_error`` =
step / 2 + float32 rounding of the decoded value. The KL bound that follows is ``compare.decisions.kl_bound``.
Only float32 outputs of shape [N, T, V >= 2] are compacted (float16 and bfloat16 already take 2 bytes, exactly).

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
sources per comparison), the compact store halves both at a bounded error (``kl_bound``: about 1e-5 nats on the
KL mean of a realistic row)."""
PARTS = ("codes", "top", "step", "second", "second_index")
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


def chosen(store: str, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> list[str]:
    """The outputs to compact under ``store`` (``shapes`` include dim 0, the number of cases)."""
    names = sorted(n for n in shapes if compactable(shapes[n], dtypes[n]))
    if store == "full" or not names:
        return []
    if store == "auto" and sum(4 * int(np.prod(shapes[n])) for n in names) <= AUTO_BYTES:
        return []
    return names


def part(name: str, what: str) -> str:
    return f"{name}{SEP}{what}"


def encode(z: np.ndarray) -> dict[str, np.ndarray]:
    """The compact parts of float32 scores ``z`` [n, T, V] (``PARTS``), block by block."""
    n, t, v = z.shape
    flat = z.reshape(n * t, v)
    out = {
        "codes": np.empty((n * t, v), dtype=np.uint16), "top": np.empty(n * t, np.float32),
        "step": np.empty(n * t, np.float32), "second": np.empty(n * t, np.float32),
        "second_index": np.empty(n * t, np.int32),
    }
    rows = max(1, BLOCK_ELEMENTS // max(v, 1))
    for a in range(0, n * t, rows):
        b = min(a + rows, n * t)
        codes, top, step, second, index = _encode_rows(flat[a:b])
        out["codes"][a:b], out["top"][a:b], out["step"][a:b], out["second"][a:b], out["second_index"][a:b] = (
            codes, top, step, second, index)
    shaped = {k: x.reshape(n, t, *x.shape[1:]) for k, x in out.items()}
    shaped["codes"] = shaped["codes"].view(np.int16)  # safetensors has no uint16 here: the same bits
    return shaped


def _encode_rows(z: np.ndarray):
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, or a sum that overflows: the general path
        every_finite = z.size and np.isfinite(z.sum(dtype=np.float64))
    if every_finite:  # every score finite (a sum's one pass): the common rows
        return _encode_finite(z)
    return _encode_general(z)


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
        np.minimum(z, second[a:b, None], out=z)
        at_top = np.nonzero(c == TOP)
        z[at_top] = top[a:b][at_top[0]]
        if c.min() <= POS_INF:  # a code of -inf, NaN or +inf in the block (rare)
            z[c == NEG_INF] = -np.inf
            z[c == NAN] = np.nan
            z[c == POS_INF] = np.inf
        has = np.flatnonzero(index[a:b] >= 0)
        z[has, index[a:b][has]] = second[a:b][has]
    return out.reshape(n, t, v)


def logit_error(top: np.ndarray, step: np.ndarray) -> float:
    """The largest |decoded - original| of any finite score of these rows: half a step, plus the float32
    rounding of a decoded value (at most ``_ROUNDING`` of its magnitude, |top| + LEVELS * step)."""
    if top.size == 0:
        return 0.0
    s = step.astype(np.float64)
    return float((0.5 * s + _ROUNDING * (np.abs(top.astype(np.float64)) + LEVELS * s)).max())
