"""Decisions of reference and trial compared: labels, ties, top-2 margins, flips, and KL per token.

Tie rule: ``lowest_index`` takes the lowest class index among the maxima; ``tie_is_flip`` marks a tie with
-1, which never equals a reference class. A row with NaN decides -2 (no decision), margin NaN.
``DecisionStats`` is fed one chunk of rows (per token: one slice of positions) at a time and keeps a few
numbers per case; ``regression_flips`` compares each value of a case with a threshold.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch

from pipeline.artifacts.comparison import Decisions, Distribution, Flip
from pipeline.compare import native
from pipeline.compare.gaps import ZERO_PROBABILITY_NATS
from pipeline.compare.quantiles import StreamQuantile
from pipeline.heads import says_logit, says_probability
from pipeline.task import IGNORE_INDEX

MARGIN_KINDS = ("logit", "probability", "relative")
KL_QUANTILES = {"median": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p99.9": 0.999}
"""The KL quantiles llama.cpp reports (with the max), by name."""


def labels_of(scores: torch.Tensor, tie_rule: str) -> torch.Tensor:
    """The class of each row (per position), by the tie rule: the labels ``_top`` gives, without the margins, in one
    pass for ``lowest_index`` (``max`` gives the first maximal index)."""
    s = scores.detach()
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()
    if s.numel() == 0:
        return torch.zeros(s.shape[:-1], dtype=torch.long, device=s.device)
    values, labels = first_max(s)
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
        empty = torch.zeros(s.shape[:-1], dtype=torch.long, device=s.device)
        top = (torch.zeros(*s.shape[:-1], k, dtype=s.dtype, device=s.device),
               torch.zeros(*s.shape[:-1], k, dtype=torch.long, device=s.device))
        return empty, top, (torch.zeros(s.shape[:-1], dtype=s.dtype, device=s.device) if need_lse else None)
    values, indices = best_two(s) if k == 2 and s.ndim == 2 else top_k(s, min(k, s.shape[-1]))  # NaN above every number
    lse = torch.logsumexp(s, dim=-1) if need_lse else None
    return _labelled(s, values, indices, tie_rule), (values, indices), lse


def _labelled(s: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, tie_rule: str) -> torch.Tensor:
    """The class of each row from its best values and indices (``_top``): -1 for a tie under ``tie_is_flip``, the lowest
    index among the maxima under ``lowest_index``, -2 for a NaN."""
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
    return labels


def decided_pair(ref: torch.Tensor, trial: torch.Tensor, k: int, tie_rule: str):
    """``_top`` of both sides (k best, with the log-sum-exps) and ``kl_and_lse`` of the pair, in one pass of the
    kernel over each row of contiguous float32 scores [..., C > k] on the CPU (``native.decide_rows``): the same
    labels, values and sets of indices, the log-sum-exps and KL within float32 rounding (KL's e^d - 1 - d from a
    series near 0, where ``kl_and_lse`` subtracts two float32 numbers). The rows the kernel leaves to torch (a
    non-finite score, a tie at the k-th best, two distributions far apart) are computed by those functions.
    Returns ((labels, (values, indices), lse) of the reference, the same of the trial, KL)."""
    shape, c = ref.shape[:-1], ref.shape[-1]
    r, t = ref.detach().reshape(-1, c).contiguous(), trial.detach().reshape(-1, c).contiguous()
    rows = r.shape[0]
    rv, tv = torch.empty(rows, k + 1), torch.empty(rows, k + 1)
    ri, ti = torch.empty(rows, k + 1, dtype=torch.int64), torch.empty(rows, k + 1, dtype=torch.int64)
    lse_r, lse_t, kl = (torch.empty(rows, dtype=torch.float64) for _ in range(3))
    flag = torch.empty(rows, dtype=torch.uint8)
    p = native.pointer
    native.library().decide_rows(p(r), p(t), rows, c, k, p(rv), p(ri, native.I64), p(tv), p(ti, native.I64),
                                 p(lse_r, native.F64), p(lse_t, native.F64), p(kl, native.F64), p(flag, native.U8))
    rv, ri, tv, ti = rv[:, :k], ri[:, :k], tv[:, :k], ti[:, :k]
    if bool(flag.any()):  # torch's path, the definition, for what the kernel leaves to it
        redo = torch.nonzero(flag == 1).flatten()
        for bit, values, indices, x in ((2, rv, ri, r), (4, tv, ti, t)):
            if redo.numel():
                values[redo], indices[redo] = top_k(x[redo], k)
            tied = torch.nonzero(flag & bit).flatten()  # ``top_k`` of a row tied at its k-th best: ``topk``'s own
            if tied.numel():
                values[tied], indices[tied] = x[tied].topk(k, dim=-1)
        if redo.numel():
            kl[redo], lse_r[redo], lse_t[redo] = kl_and_lse(r[redo], t[redo], ref_argmax=ri[redo, 0])
    sides = []
    for values, indices, x, lse in ((rv, ri, r, lse_r), (tv, ti, t, lse_t)):
        values, indices = values.reshape(*shape, k), indices.reshape(*shape, k)
        sides.append((_labelled(x.reshape(*shape, c), values, indices, tie_rule), (values, indices), lse.reshape(shape)))
    return sides[0], sides[1], kl.reshape(shape)


def best_rows(scores: torch.Tensor, k: int, lse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The ``k`` best of each row of float32 scores [..., C >= k] on the CPU (values descending, indices; equal values by
    lowest index: ``best_two``'s for k = 2) and, if ``lse``, its log-sum-exp (float64), in one pass of the kernel
    (``native.best_rows``); None where a score is not finite (the caller's torch path)."""
    shape, c = scores.shape[:-1], scores.shape[-1]
    x = scores.detach().reshape(-1, c).contiguous()
    rows = x.shape[0]
    values, indices = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    sums, flag = torch.empty(rows, dtype=torch.float64) if lse else None, torch.empty(rows, dtype=torch.uint8)
    p = native.pointer
    native.library().best_rows(p(x), rows, c, k, p(values), p(indices, native.I64), None if sums is None else p(sums, native.F64),
                               p(flag, native.U8))
    if bool(flag.any()):
        return None
    return values.reshape(*shape, k), indices.reshape(*shape, k), None if sums is None else sums.reshape(shape)


def labels_and_lse(scores: torch.Tensor, tie_rule: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``labels_of`` and the log-sum-exp (float64) of float32 scores [..., C >= 2] on the CPU through ``best_rows``
    (one pass where ``labels_of`` and ``log_softmax`` take three); (None, None) where a score is not finite (the
    caller's torch path)."""
    best = best_rows(scores, 2, True)
    if best is None:
        return None, None
    return _labelled(scores, best[0], best[1], tie_rule), best[2]


def first_max(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s.max(dim=-1)``: each row's maximum and its first index (a NaN where the row holds one). On a CPU through
    numpy's ``argmax``, the same answer about 15x faster than torch's ``max(dim)`` over 1,000 classes on one thread."""
    if s.device.type != "cpu":
        return s.max(dim=-1)
    a = s.numpy()
    index = a.argmax(-1)
    return torch.from_numpy(np.take_along_axis(a, index[..., None], -1)[..., 0]), torch.from_numpy(index)


def best_two(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s.topk(2, dim=-1)`` of scores [N, C]: the same values (NaN above every number) from two ``first_max``, 4x
    faster on a CPU; the indices are the first of each value (``topk``'s order among equal values is its own, so
    only the values and a label without a tie are ``topk``'s: what a decision per case reads)."""
    best, first = first_max(s)
    rest = s.clone()
    rest.scatter_(-1, first.unsqueeze(-1), -math.inf)
    second, then = first_max(rest)
    return torch.stack([best, second], -1), torch.stack([first, then], -1)


GROUPS = 8
"""``top_k`` splits a row of scores into this many interleaved groups of columns."""
TOP_K_GROUPED = 2048
"""Fewest classes for which ``top_k`` goes through the groups: below, ``topk`` itself is as fast (measured on one
CPU thread: 0.6x ``topk``'s time at 4,000 classes, 0.3x at 50,000, slower at 1,000)."""


def top_k(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``s.topk(k, dim=-1)``, faster on a CPU for many classes: the same values, the same set of indices (in
    ``topk``'s order where the values differ; among equal values within the k best, in another: only the values,
    the set and a best index without a tie are read). The k + 1 best scores of a row lie in the k + 1 groups of
    columns whose maxima are best (``GROUPS`` interleaved groups: one vectorized max), so ``topk`` runs on those
    few candidates; a row whose k-th and (k + 1)-th best are equal, or with a NaN, takes ``topk`` itself (which of
    the equal ones it keeps is its own rule)."""
    c = s.shape[-1]
    width = c // GROUPS
    if s.device.type != "cpu" or c < TOP_K_GROUPED or width < 8 * (k + 1) or s.numel() == 0:
        return s.topk(k, dim=-1)
    group_max = s[..., : GROUPS * width].unflatten(-1, (GROUPS, width)).amax(-2)  # column j: j, j + width, ...
    best = group_max.topk(k + 1, dim=-1).indices
    columns = (best.unsqueeze(-2) + torch.arange(0, GROUPS * width, width).unsqueeze(-1)).flatten(-2)
    if c > GROUPS * width:  # the last columns, outside every group: candidates themselves
        rest = torch.arange(GROUPS * width, c)
        columns = torch.cat([columns, rest.expand(*columns.shape[:-1], rest.numel())], -1)
    values, where = s.gather(-1, columns).topk(k + 1, dim=-1)
    indices = columns.gather(-1, where)
    again = (values[..., k - 1] == values[..., k]) | torch.isnan(values[..., 0])
    values, indices = values[..., :k].contiguous(), indices[..., :k].contiguous()
    if bool(again.any()):
        values[again], indices[again] = s[again].topk(k, dim=-1)
    return values, indices


def listed_top(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of one row of scores and their classes, in one order on every device: NaN first, then by value,
    equal values by the lowest class (``topk``'s order among equal values is its own, and differs between the CPU and
    a GPU: an all-NaN row of a flip listed 28 first on one and 1 on the other)."""
    if 0 < k < s.shape[-1]:  # the common row, no NaN and its k-th best above the next: topk's k are the k best
        values, classes = s.topk(k + 1)
        if not bool(torch.isnan(values[0])) and bool(values[k - 1] > values[k]):
            classes = classes[:k].sort().values  # ascending: the stable sort below orders equal values by class
            order = torch.sort(s[classes], descending=True, stable=True).indices
            return s[classes[order]], classes[order]
    nan = torch.isnan(s)
    first = nan.nonzero().reshape(-1)[:k]
    need = k - first.numel()
    if need > 0:
        rest = s.masked_fill(nan, -math.inf)
        kth = rest.topk(need).values[-1]
        candidates = ((rest >= kth) & ~nan).nonzero().reshape(-1)  # ascending: the stable sort orders ties by class
        order = torch.sort(s[candidates], descending=True, stable=True).indices[:need]
        first = torch.cat([first, candidates[order]])
    return s[first], first


def _ties_differ(ref: torch.Tensor, trial: torch.Tensor, r_lab: torch.Tensor, t_lab: torch.Tensor) -> torch.Tensor:
    """Under ``tie_is_flip`` both sides tied (label -1): a flip unless they tie among the same classes."""
    both = (r_lab == -1) & (t_lab == -1)
    out = torch.zeros_like(both)
    if bool(both.any()):
        r, t = ref.detach()[both].float(), trial.detach()[both].float()
        out[both] = ((r == r.amax(-1, keepdim=True)) != (t == t.amax(-1, keepdim=True))).any(-1)
    return out


def margins(top, kind: str, lse: torch.Tensor | None, scores: torch.Tensor | None = None,
            spread: torch.Tensor | None = None) -> torch.Tensor:
    """Top-2 margin of each decision, in float64, in the unit ``kind`` names:

    - ``logit``: z1 - z2, in the scores' own unit (depends on their scale);
    - ``probability``: p1 - p2 of the softmax, in [0, 1] (needs the log-sum-exp ``lse``);
    - ``relative``: (z1 - z2) / std(z) over the live classes (``live_spread``), in units of the row's own spread; inf
      for a row with one live class (every other at probability 0: the clearest decision there is, never near);
      ``spread``, where given, in place of ``live_spread(scores)`` (a compact store's, ``compact.row_spread``).
    """
    values = top[0].double()
    gap = values[..., 0] - values[..., 1]
    if kind == "logit":
        return gap
    if kind == "probability":
        lse = lse.double()
        return torch.exp(values[..., 0] - lse) - torch.exp(values[..., 1] - lse)
    if kind == "relative":  # one live class (spread inf: no second score to be near) is as far as a margin goes
        if spread is None:
            spread = live_spread(scores.detach().double()) if scores.shape[-1] > 1 else torch.ones_like(gap)
        spread = spread.to(gap)
        relative = torch.where(spread > 0, gap / spread, torch.zeros_like(gap))
        return torch.where(torch.isinf(spread), torch.full_like(gap, math.inf), relative)
    raise ValueError(f"unknown margin kind {kind!r}; use one of {MARGIN_KINDS}")


def settled_margins(margin: torch.Tensor, top, lse: torch.Tensor | None, scores: torch.Tensor, boundary: float,
                    kind: str = "probability") -> torch.Tensor:
    """The ``probability`` or ``relative`` margins of a slice, or, for the whole slice where one of them lies within
    rounding of ``boundary`` or is not finite, the margins of the one definition (``compact.row_lse``,
    ``compact.row_spread``: float64, row by row), which the compact store keeps too: which side of the boundary a case
    falls on is then the same on the kernels' path, torch's and either store, as the tolerance's recount settles a
    gap at atol.

    Probability: two log-sum-exps differ by at most a few float32 roundings: of the result (|lse|), of each score's
    distance to the maximum and of the sum (under 2 ln C + log2 C units of 2**-24 together). A margin p1 - p2 moves
    by (p1 - p2) times that; the slack below is 16 times it. Relative: two float64 spreads of C scores differ by far
    less than 2**-30 of themselves."""
    if kind == "probability":
        slack = 2.0**-20 * (lse.abs() + 4.0 * math.log(scores.shape[-1]) + 16.0) * margin.abs() + 2.0**-48
    else:
        slack = 2.0**-30 * margin.abs() + 2.0**-60
    if not bool((~((margin - boundary).abs() > slack) & ~torch.isinf(margin)).any()):  # NaN: not settled either
        return margin
    from pipeline.artifacts import compact

    z = scores.detach().float().cpu().reshape(-1, scores.shape[-1]).numpy()
    if kind == "probability":
        exact = torch.from_numpy(compact.row_lse(z).reshape(scores.shape[:-1]))
        return margins(top, kind, exact.to(margin.device)).to(margin)
    exact = torch.from_numpy(compact.row_spread(z).reshape(scores.shape[:-1]))
    return margins(top, kind, None, scores, spread=exact.to(margin.device)).to(margin)


def live_spread(s: torch.Tensor) -> torch.Tensor:
    """The standard deviation of each row's scores over its live classes: those within ``ZERO_PROBABILITY_NATS`` of
    the row's maximum. A class masked out (``finfo.min``, -inf, ``where(allowed, x, -1e9)``: probability 0) is no
    score of the row: counted, its -3.4e38 would set the spread at 1e38, every relative margin at 0 and every case
    near the boundary, and -inf would give NaN. A row with one live class has no second score to be near: inf. A row
    with no finite maximum: NaN. Rows without a masked class: ``std`` itself."""
    top = s.amax(-1, keepdim=True)
    live = s >= top - ZERO_PROBABILITY_NATS
    if bool(live.all()):
        return s.std(dim=-1)
    count = live.sum(-1)
    mean = torch.where(live, s, 0.0).sum(-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
    var = torch.where(live, (s - mean).square(), 0.0).sum(-1) / (count - 1).clamp(min=1)
    spread = torch.where(count > 1, var.sqrt(), torch.full_like(var, math.inf))
    return torch.where(torch.isfinite(top.squeeze(-1)), spread, torch.full_like(spread, math.nan))


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
    if r.numel() and r.numel() == r.shape[-1]:  # one row: computed beside a copy of itself (``_apart``)
        two = [None if x is None else _apart(x.reshape(1, -1)) for x in (r, t, diff)]
        kl, lse_ref, lse_trial = kl_and_lse(*two, ref_argmax=None if ref_argmax is None else ref_argmax.reshape(1).repeat(2))
        return tuple(None if x is None else x[:1].reshape(r.shape[:-1]) for x in (kl, lse_ref, lse_trial))
    if r.numel() == 0:
        empty = torch.zeros(r.shape[:-1], dtype=torch.float64, device=r.device)
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
        m = int(large.sum())
        rl, tl, pl = (_apart(x[large].double()) for x in (r, t, p))
        lse_r = torch.logsumexp(rl, dim=-1)[:m]
        lse_t = torch.logsumexp(tl, dim=-1)[:m]
        # Over the support of p only: a class the reference rules out (-inf logit, a masked vocabulary)
        # adds nothing, where the pieces above would give 0 * inf = NaN for identical outputs.
        direct = lse_t - lse_r - torch.where(pl > 0, pl * (tl - rl), torch.zeros_like(pl)).sum(-1)[:m]
        kl[large] = torch.where(torch.isfinite(direct), direct, torch.full_like(direct, math.inf))
        if lse_trial is not None:
            lse_trial[large] = lse_t
    return kl.clamp_(min=0.0), lse_ref, lse_trial


def _apart(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [m, C], with a copy of the row beside it where m is 1: torch splits one row's sum over its threads
    (past 32,768 elements), in another order than the same row's beside others, so that a token's KL would depend on
    the block it came in (compare's slices, the trial's chunks: ``token_kl``). Two rows or more sum one row per thread."""
    return torch.cat([x, x]) if x.shape[0] == 1 else x


def fuses(kernels: bool | None, k: int, ref: torch.Tensor, trial: torch.Tensor) -> bool:
    """Whether per-token scores go through the kernels (``decided_pair``) rather than torch's ``_top`` and ``kl_and_lse``:
    one choice for ``DecisionStats.update`` and ``token_kl``; ``kernels``: ``native.wanted`` for the output's size."""
    return bool(kernels and k <= native.MAX_K and k < ref.shape[-1] and ref.dtype == trial.dtype == torch.float32
                and ref.device.type == "cpu")


def token_kl(ref: torch.Tensor, trial: torch.Tensor, top_k: int, elements: int) -> torch.Tensor:
    """KL(reference || trial) of each token of per-token scores [n, T, C] on the CPU, float64: the numbers
    ``DecisionStats.update`` computes of the same scores for ``top_k`` in compare (``decided_pair``'s where it ``fuses``,
    with the kernels ``native.wanted`` for an output of ``elements``, else ``kl_and_lse``'s), the same bits for a token in
    any block of rows or positions, on the same machine. A trial stored compact keeps them (``artifacts.compact``): from
    its decoded scores they would move by up to ``kl_bound``."""
    k = min(max(top_k, 2), ref.shape[-1])
    if fuses(native.wanted(elements, ref.device), k, ref, trial):
        return decided_pair(ref, trial, k, "lowest_index")[2]
    return kl_and_lse(ref, trial)[0]


def kl_bound(kl: float, alpha: float, beta: float) -> float:
    """Largest |KL(p || q) - KL(p' || q')| of one token whose log-probabilities are known within ``alpha``
    (reference) and ``beta`` (trial), given the computed KL(p' || q') = ``kl``; concave and increasing in ``kl``,
    so that at the mean KL it bounds the error of the mean, and at a quantile that of the quantile.

    With a = e^alpha - 1, b = e^beta - 1 and s = min(2, sqrt(2 kl)) (Pinsker: the total variation of p', q'):
    KL - KL' = sum (p - p') X' + KL(p || p') - sum (p - q)(t - t') - KL(q || q') with X' = log p'/q', where
    |p - p'| <= a p', E_p'|X'| <= kl + s, KL(. || .') <= chi^2 <= a^2 (b^2) and ||p - q||_1 <= a + s + b:
    the bound is a (kl + s) + a^2 + b^2 + beta (a + s + b). A decoded score within e of its own gives
    log-probabilities within 2e (the log-sum-exp moves by at most e): ``alpha`` = 2 ``logit_error``.
    """
    if alpha == 0.0 and beta == 0.0:
        return 0.0
    if not math.isfinite(kl):
        return math.inf
    a, b, s = math.expm1(alpha), math.expm1(beta), min(2.0, math.sqrt(2.0 * max(kl, 0.0)))
    return a * (kl + s) + a * a + b * b + beta * (a + s + b)


@dataclass(frozen=True)
class Labels:
    """Both sides' decisions of one slice and, per token, their log-sum-exps: for the quality to reuse."""

    reference: torch.Tensor
    trial: torch.Tensor
    lse_reference: torch.Tensor | None = None
    lse_trial: torch.Tensor | None = None

    def of(self, side: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(labels, log-sum-exps) of ``side``; none for a side not decided here (the trained model's)."""
        if side == "reference":
            return self.reference, self.lse_reference
        if side == "trial":
            return self.trial, self.lse_trial
        return None, None


@dataclass(frozen=True)
class PerCase:
    """A few numbers per case, in case order, updated in place slice by slice: flips (per token: flipped
    tokens), the reference margin (per token: the smallest), reference and trial class (per case), KL's sum,
    largest and worst token over the target tokens (per token)."""

    flips: torch.Tensor
    margin: torch.Tensor
    reference_class: torch.Tensor
    trial_class: torch.Tensor
    kl_sum: torch.Tensor
    tokens: torch.Tensor
    kl_max: torch.Tensor
    worst_token: torch.Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device | None = None) -> "PerCase":
        """Before any slice: no flip, an infinite margin, class -3 (none yet)."""
        long, double = {"dtype": torch.int64, "device": device}, {"dtype": torch.float64, "device": device}
        return cls(flips=torch.zeros(n, **long), margin=torch.full((n,), math.inf, **double),
                   reference_class=torch.full((n,), -3, **long), trial_class=torch.full((n,), -3, **long),
                   kl_sum=torch.zeros(n, **double), tokens=torch.zeros(n, **long),
                   kl_max=torch.zeros(n, **double), worst_token=torch.zeros(n, **long))

    def cpu(self) -> "PerCase":
        return PerCase(**{f.name: getattr(self, f.name).cpu() for f in fields(self)})

    @property
    def kl_mean(self) -> torch.Tensor:
        return self.kl_sum / self.tokens.clamp(min=1)


class DecisionStats:
    """Decisions of reference and trial compared, per case ([N, C]) or per token ([N, T, C]), slice by slice.

    Flips are counted in three exact groups:
    - ``boundary_flips`` among the constructed boundary cases (kind ``boundary``), limited as a fraction;
    - ``near_boundary_flips`` among REAL cases (ordinary, edge) whose reference margin, in the unit
      ``margin_kind``, is below ``boundary_margin``: limited apart, never silently allowed;
    - ``flips`` among real cases farther from the boundary.
    Per-token outputs also give the distribution agreement: KL(reference || trial) per token (mean,
    p99, max), top-1 agreement and top-k overlap, over the ordinary cases' tokens (the sample: ``rate_sample``; a
    selected copy or an edge case is no draw of the data, and would narrow the mean's SE or move its quantiles), the
    max over every real token. Tokens whose target is -100 are ignored.
    ``flip_list`` holds every flipped case (per token: at most ``max_listed`` tokens, the count stays exact).
    Per-case summaries (``per_case``) are kept for every case: a few numbers each.
    """

    def __init__(self, ids: Sequence[str], kinds: Sequence[str], tie_rule: str, boundary_margin: float, margin_kind: str,
                 capacity_tokens: int, top_k: int = 5, max_listed: int = 10_000, device: torch.device | None = None,
                 kernels: bool | None = None) -> None:
        self.ids, self.kinds = ids, kinds
        self.tie_rule, self.boundary_margin, self.margin_kind = tie_rule, boundary_margin, margin_kind
        self.top_k, self.max_listed = top_k, max_listed
        self.cases = self.boundary_cases = self.near_boundary_cases = 0
        self.flips = self.near_boundary_flips = self.boundary_flips = 0
        self.flip_list: list[Flip] = []
        self.listed_dropped = 0
        self.per_token = False
        self.tokens = 0
        self.top1_agree = 0
        self.overlap_sum = 0.0
        self.kl_sum = 0.0
        self.kl_m2 = 0.0
        self.kl_max = 0.0
        self.kl_q = StreamQuantile(0.99, max(capacity_tokens, 1))
        self.kl_quantiles = {name: self.kl_q if q == 0.99 else StreamQuantile(q, max(capacity_tokens, 1))
                             for name, q in KL_QUANTILES.items()}
        self.dp_sq = 0.0
        self.dp_tokens = 0
        self.logit_error = (0.0, 0.0)
        """Largest error of a decoded score of the reference and of the trial (compact store; 0 when full)."""
        self.kl_stored = False
        """Whether KL per token was read as the trial stored it (``update``'s ``stored_kl``): exact, no store bound."""
        self.stores: dict[str, str] = {}
        """Which store each side was read from (``full``, ``compact``): for the record."""
        self.constructed = torch.tensor([k == "boundary" for k in kinds], dtype=torch.bool, device=device)
        self.drawn = torch.tensor([k == "ordinary" for k in kinds], dtype=torch.bool, device=device)
        """The ordinary cases: the sample (``rate_sample``) the distribution statistics are taken over, per token."""
        self._case = PerCase.empty(len(ids), device)  # on the device the slices come from
        self.probabilities: bool | None = None
        """Whether the scores are probabilities (``probability_rows`` of the first slice): a ``logit`` margin is then
        p1 - p2, and the record says ``probability``."""
        self.capacity = capacity_tokens
        self.kernels = kernels
        """Whether per-token slices go through ``decided_pair`` (None: the output's size decides at the first slice)."""
        self._twin = twins(ids)
        self._twin_rows = sorted(self._twin)
        self._seen: dict[int, torch.Tensor] = {}
        """Per row of a selected copy or its twin, by position: counted, valid, flipped, near (``_one_input_once``)."""

    def update(self, row: int, ref: torch.Tensor, trial: torch.Tensor, targets: torch.Tensor | None = None,
               position: int = 0, diff: torch.Tensor | None = None,
               exact: tuple[torch.Tensor, torch.Tensor] | None = None, stored_kl: torch.Tensor | None = None) -> Labels:
        """Cases ``row:row + len(ref)`` (positions ``position:position + T'`` for [n, T', C] scores). ``exact``: the
        reference rows' log-sum-exp and live spread as a compact store keeps them (``compact.row_lse``, ``row_spread``
        of the original scores), which its probability and relative margins read in place of the decoded scores'.
        ``stored_kl``: each token's KL as a compact trial stored it (``token_kl`` of the full scores), read in place of the
        decoded scores'.

        Returns the decisions of both sides (``Labels``) for reuse."""
        n = ref.shape[0]
        per_token = ref.ndim == 3
        self.per_token = per_token
        if self.probabilities is None and n:  # read once: an output holds probabilities or does not
            self.probabilities = probability_rows(ref)
        need_lse = self.margin_kind == "probability"
        k = min(max(self.top_k, 2), ref.shape[-1]) if per_token else 2
        if self.kernels is None:  # by the output's size (``native.MIN_ELEMENTS``)
            self.kernels = native.wanted(self.capacity * ref.shape[-1], ref.device)
        fused = fuses(self.kernels, k, ref, trial)
        best = None if per_token or not fused else best_rows(ref, 2, need_lse)  # None: torch's path
        if per_token and fused:
            (r_lab, r_top, r_lse), (t_lab, t_top, t_lse), kl = decided_pair(ref, trial, k, self.tie_rule)
        elif best is not None:
            r_top, r_lse = best[:2], best[2]
            r_lab = _labelled(ref, *r_top, self.tie_rule)
        else:
            r_lab, r_top, r_lse = _top(ref, k, self.tie_rule, need_lse)
        if exact is not None and self.margin_kind in ("probability", "relative"):  # the definition's, as stored
            r_margin = margins(r_top, self.margin_kind, exact[0].to(ref.device), ref, spread=exact[1].to(ref.device))
        else:
            r_margin = margins(r_top, self.margin_kind, r_lse, ref)
            if self.margin_kind in ("probability", "relative"):
                r_margin = settled_margins(r_margin, r_top, r_lse, ref, self.boundary_margin, self.margin_kind)
        if per_token:  # top-k overlap needs the trial's k best
            if not fused:
                t_lab, t_top, t_lse = _top(trial, k, self.tie_rule, need_lse)
            t_margin = margins(t_top, self.margin_kind, t_lse, trial)
        else:  # the trial's margin is only reported for flipped cases: computed for them alone, below
            t_lab = labels_of(trial, self.tie_rule)  # (numpy's argmax: faster than the kernel for a label alone)
            t_margin = None
        rows = slice(row, row + n)
        constructed = self.constructed[rows]
        if per_token:
            valid = (targets != IGNORE_INDEX) if targets is not None else torch.ones(r_lab.shape, dtype=torch.bool,
                                                                                       device=r_lab.device)
            constructed_pos = constructed[:, None].expand_as(r_lab)
        else:
            valid = torch.ones(n, dtype=torch.bool, device=r_lab.device)
            constructed_pos = constructed
        flipped = ((r_lab != t_lab) | _ties_differ(ref, trial, r_lab, t_lab)) & valid
        near = (r_margin < self.boundary_margin) & valid & ~constructed_pos  # NaN margins are never "near"
        self.cases += int(valid.sum())
        self.boundary_cases += int((constructed_pos & valid).sum())
        self.near_boundary_cases += int(near.sum())
        self.boundary_flips += int((flipped & constructed_pos).sum())
        self.near_boundary_flips += int((flipped & near).sum())
        self.flips += int((flipped & ~constructed_pos & ~near).sum())
        if self._twin_rows:
            self._one_input_once(row, position, valid, flipped, near)
        case = self._case
        if not per_token:
            case.flips[rows] = flipped.long()
            case.margin[rows] = r_margin
            case.reference_class[rows] = r_lab
            case.trial_class[rows] = t_lab
            where = torch.nonzero(flipped).flatten()
            if where.numel():
                t_sub = trial[where]
                _, top_sub, lse_sub = _top(t_sub, 2, self.tie_rule, need_lse)
                t_margin = margins(top_sub, self.margin_kind, lse_sub, t_sub)
            for j, i in enumerate(where.tolist()):
                self.flip_list.append(self._record(row + i, None, bool(near[i]), int(r_lab[i]), int(t_lab[i]),
                                                   float(r_margin[i]), float(t_margin[j]), ref[i], trial[i]))
            return Labels(r_lab, t_lab)
        if fused:
            lse_r, lse_t = r_lse, t_lse
        else:
            kl, lse_r, lse_t = kl_and_lse(ref, trial, diff, ref_argmax=r_top[1][..., 0])
        if stored_kl is not None:  # (the decoded scores' KL is within ``kl_bound`` of it; the stored one is full's)
            kl, self.kl_stored = stored_kl.to(kl.device), True
        sample = valid & self.drawn[rows][:, None]  # a selected copy or an edge case is no draw of the data
        self._add_kl(kl[sample], kl[valid])
        if targets is not None:
            self._add_delta_p(ref, trial, targets, sample, lse_r, lse_t)
        self.top1_agree += int((~flipped & sample).sum())
        # a NaN among the trial's k best ranks no class (which NaNs topk keeps differs between devices): no overlap
        same = (r_top[1][..., :, None] == t_top[1][..., None, :]) & ~torch.isnan(t_top[0])[..., None, :]
        ov = same.any(-1).sum(-1).double() / k
        self.overlap_sum += float(ov[sample].sum())
        if kl.shape[1]:
            kl_masked = torch.where(valid, kl, torch.zeros_like(kl))
            case.flips[rows] += flipped.sum(1)
            case.kl_sum[rows] += kl_masked.sum(1)
            case.tokens[rows] += valid.sum(1)
            block_max, block_arg = kl_masked.max(1)
            better = block_max > case.kl_max[rows]
            case.worst_token[rows] = torch.where(better, block_arg + position, case.worst_token[rows])
            case.kl_max[rows] = torch.maximum(block_max, case.kl_max[rows])
            m = torch.where(valid, r_margin, torch.full_like(r_margin, math.inf)).min(1).values
            case.margin[rows] = torch.minimum(case.margin[rows], m)
        where = torch.nonzero(flipped)
        room = self.max_listed - len(self.flip_list)
        if where.shape[0] > room:
            self.listed_dropped += where.shape[0] - max(room, 0)
            where = where[: max(room, 0)]
        for i, j in where.tolist():
            rec = self._record(row + i, position + j, bool(near[i, j]), int(r_lab[i, j]), int(t_lab[i, j]), float(r_margin[i, j]),
                               float(t_margin[i, j]), ref[i, j], trial[i, j])
            self.flip_list.append(replace(rec, kl=float(kl[i, j])))
        return Labels(r_lab, t_lab, lse_r, lse_t)

    def _one_input_once(self, row: int, position: int, valid: torch.Tensor, flipped: torch.Tensor, near: torch.Tensor) -> None:
        """A ``selected/X`` copy and its twin ``ordinary/X`` are one input (``twins``): a decision changed on both is one
        change, a position near the boundary on both one near case, as ``rate_sample`` counts them for the flip rate
        (else a count limit of 1 rolls back the one change of one input). Whichever of the two comes second to a position
        gives back what the first counted there already."""
        lo, hi = bisect.bisect_left(self._twin_rows, row), bisect.bisect_left(self._twin_rows, row + valid.shape[0])
        for r in self._twin_rows[lo:hi]:
            mine = torch.stack([v[r - row].reshape(-1) for v in (valid, flipped, near)]).cpu()
            width = position + mine.shape[1]
            other = self._held(self._twin[r], width)[:, position:width]
            both = mine & other[1:] & other[:1]  # where the twin was counted already
            self.cases -= int(both[0].sum())
            self.near_boundary_cases -= int(both[2].sum())
            self.near_boundary_flips -= int((both[1] & mine[2]).sum())
            self.flips -= int((both[1] & ~mine[2]).sum())
            kept = self._held(r, width)
            kept[0, position:width] = True
            kept[1:, position:width] = mine

    def _held(self, r: int, width: int) -> torch.Tensor:
        """Row ``r``'s record (``_seen``: counted, valid, flipped, near by position), at least ``width`` positions long."""
        kept = self._seen.get(r, torch.zeros(4, 0, dtype=torch.bool))
        if kept.shape[1] < width:
            kept = torch.cat([kept, torch.zeros(4, width - kept.shape[1], dtype=torch.bool)], 1)
        self._seen[r] = kept
        return kept

    def _add_kl(self, kl_v: torch.Tensor, kl_all: torch.Tensor) -> None:
        """Count, sum, spread (Chan's merge of the slice's mean and squared deviations) and quantiles of KL over the
        sample's tokens ``kl_v``; its max over every real token ``kl_all`` (a superset's max is never below)."""
        if kl_all.numel():
            self.kl_max = max(self.kl_max, float(kl_all.max()))
        n = kl_v.numel()
        if n:
            mean = float(kl_v.mean())
            m2 = float(((kl_v - mean) ** 2).sum())
            total = self.tokens + n
            delta = mean - (self.kl_sum / self.tokens if self.tokens else 0.0)
            self.kl_m2 += m2 + delta * delta * self.tokens * n / total
            self.kl_sum += float(kl_v.sum())
            self.tokens = total
        for q in self.kl_quantiles.values():
            q.update(kl_v)

    def _add_delta_p(self, ref, trial, targets, valid, lse_r, lse_t) -> None:
        """Squared change of the probability of each valid token's target (llama.cpp's delta p), summed."""
        keep = valid & (targets >= 0)
        if not bool(keep.any()):
            return
        y = targets.clamp(min=0).unsqueeze(-1)
        p_r = torch.exp(ref.gather(-1, y).squeeze(-1).double() - lse_r)
        p_t = torch.exp(trial.gather(-1, y).squeeze(-1).to(torch.float64) - lse_t)
        dp = (p_t - p_r)[keep]
        self.dp_sq += float(torch.nan_to_num(dp * dp, nan=1.0).sum())
        self.dp_tokens += int(dp.numel())

    def _record(self, case: int, position, near, rc, tc, rm, tm, r_scores, t_scores) -> Flip:
        scores: dict = {}
        if r_scores.numel() <= 16:
            scores = {"reference_scores": tuple(r_scores.double().tolist()), "trial_scores": tuple(t_scores.double().tolist())}
        else:  # a vocabulary: the top 5 of each side
            for side, s in (("reference", r_scores), ("trial", t_scores)):
                v, i = listed_top(s.float(), 5)
                scores[f"{side}_top"] = tuple(zip(i.tolist(), v.double().tolist()))
        return Flip(id=self.ids[case], kind=self.kinds[case], boundary=bool(self.constructed[case]), near_boundary=near,
                    reference_class=rc, trial_class=tc, reference_margin=rm, trial_margin=tm, margin_kind=self.margin_kind,
                    position=position, **scores)

    def per_case(self) -> PerCase:
        """Per case, in case order (``PerCase``, on the CPU): the classes read per case, KL's numbers per token."""
        return self._case.cpu()

    def result(self) -> Decisions:
        case = self._case.cpu()
        kind = "probability" if self.margin_kind == "logit" and self.probabilities else self.margin_kind  # the unit measured
        units = case.tokens if self.per_token else torch.ones(len(self.ids), dtype=torch.int64)
        sample, sample_flips = rate_sample(self.ids, self.kinds, case.flips, units)
        return Decisions(
            cases=self.cases,
            boundary_cases=self.boundary_cases,
            near_boundary_cases=self.near_boundary_cases,
            flips=self.flips,
            near_boundary_flips=self.near_boundary_flips,
            boundary_flips=self.boundary_flips,
            unit="token" if self.per_token else "case",
            margin_kind=kind,
            boundary_margin=self.boundary_margin,
            boundary_flip_fraction=self.boundary_flips / self.boundary_cases if self.boundary_cases else 0.0,
            real_flips=self.flips + self.near_boundary_flips,
            flip_list=tuple(replace(f, margin_kind=kind) for f in self.flip_list),
            flip_list_dropped=self.listed_dropped,
            sample=sample,
            sample_flips=sample_flips,
        )

    def distribution(self) -> Distribution | None:
        """Distribution agreement of per-token outputs (None for per-case classification)."""
        if not self.per_token:
            return None
        n = self.tokens
        mean = self.kl_sum / n if n else 0.0
        agree = self.top1_agree / n if n else 1.0
        alpha, beta = (0.0, 0.0) if self.kl_stored else (2.0 * e for e in self.logit_error)
        p99_upper = self.kl_q.upper()  # never below the exact value: what a gate reads
        return Distribution(
            tokens=n,
            kl_mean=mean,
            kl_p99=self.kl_q.result(),
            kl_p99_upper=p99_upper,
            kl_p99_exact=self.kl_q.exact,
            kl_max=self.kl_max,
            top1_agreement=agree,
            top_k=self.top_k,
            top_k_overlap=self.overlap_sum / n if n else 1.0,
            kl_mean_se=math.sqrt(self.kl_m2 / (n - 1) / n) if n > 1 else 0.0,
            kl_quantiles={"max": self.kl_max, **{name: q.result() for name, q in self.kl_quantiles.items()}},
            kl_quantiles_exact=all(q.exact for q in self.kl_quantiles.values()),
            top1_agreement_se=math.sqrt(agree * (1.0 - agree) / n) if n else 0.0,
            rms_delta_p=math.sqrt(self.dp_sq / self.dp_tokens) if self.dp_tokens else None,
            store=dict(sorted(self.stores.items())),
            logit_error=max(self.logit_error),
            kl_mean_bound=kl_bound(mean, alpha, beta),
            kl_p99_bound=kl_bound(p99_upper, alpha, beta),
            kl_max_bound=kl_bound(self.kl_max, alpha, beta),
        )


def twins(ids: Sequence[str], positions: Sequence[int] | None = None) -> dict[int, int]:
    """Each ``selected/X`` case whose ordinary twin ``ordinary/X`` is in the set, and that twin, mapped to each other
    (by index; with ``positions``, per token: the same position of each): one input twice (``cases._select`` copies a
    real sample picked for its small margin), whose changed decisions are one."""
    at = positions if positions is not None else [0] * len(ids)
    where = {(i, int(p)): n for n, (i, p) in enumerate(zip(ids, at))}
    out: dict[int, int] = {}
    for n, (i, p) in enumerate(zip(ids, at)):
        kind, _, rest = i.partition("/")
        twin = where.get(("ordinary/" + rest, int(p))) if kind == "selected" else None
        if twin is not None:
            out[n], out[twin] = twin, n
    return out


_SAMPLE_KIND = {"ordinary": 0, "selected": 2, "boundary": 3}
"""``rate_sample``'s codes of the kinds: any other kind (edge) is a real case, not a draw (1)."""


def rate_sample(ids: Sequence[str], kinds: Sequence[str], flips: torch.Tensor | Sequence[int],
                units: torch.Tensor | Sequence[int]) -> tuple[int, int]:
    """The sample a flip rate is bounded on (``max_flip_rate``: Clopper–Pearson assumes independent draws of the data),
    as (units, flips), from each case's changed decisions ``flips`` and judged ``units`` (1 per case; per token its
    kept positions; ``ids`` may repeat: a case's counts add up).

    Only ordinary cases are such draws: a ``selected/X`` case is ordinary X again (a copy picked for its small margin)
    and an edge case is built (zeros, a scaled copy, the user's own), so counting their units would narrow the bound
    on the same evidence (a set of 290 with 30 copies passing 1 % at 95 %, which needs 299 draws). Their flips still
    count against the sample, as changed decisions the application would act on: an edge case's all of them, a
    selected copy's those its ordinary twin does not show already (the larger of the two counts: the same input
    changing on both is one change). Capped at the units (no rate above 1)."""
    f, u = torch.as_tensor(flips, dtype=torch.int64).reshape(-1), torch.as_tensor(units, dtype=torch.int64).reshape(-1)
    if len(set(ids)) != len(ids):  # units of one case (a head's positions): their counts add up, per case
        first = {i: n for n, i in reversed(list(enumerate(ids)))}
        case = torch.tensor([first[i] for i in ids], dtype=torch.int64)
        f, u = (torch.zeros(len(ids), dtype=torch.int64).index_add_(0, case, v) for v in (f, u))
        keep = sorted(first.values())
        ids, kinds, f, u = [ids[n] for n in keep], [kinds[n] for n in keep], f[keep], u[keep]
    code = torch.tensor([_SAMPLE_KIND.get(k, 1) for k in kinds], dtype=torch.int64)  # 0 ordinary, 1 other real
    sample = int(u[code == 0].sum())
    changed = int(f[code <= 1].sum())
    selected = torch.nonzero(code == 2).flatten().tolist()
    if selected:  # a copy adds the changes its ordinary twin does not show (the same input, one change where both do)
        twins = {"ordinary/" + ids[n].partition("/")[2] for n in selected}
        where = {i: n for n, i in enumerate(ids) if i in twins}
        for n in selected:
            twin = where.get("ordinary/" + ids[n].partition("/")[2])
            changed += max(int(f[n]) - (int(f[twin]) if twin is not None else 0), 0)
    return sample, min(changed, sample)


def probability_rows(v: torch.Tensor) -> bool:
    """Whether every row of ``v`` (over its last axis) is a probability distribution: finite, non-negative, summing to 1
    (within float32 rounding of a softmax over many classes)."""
    v = v.detach()
    if not v.numel() or not bool(v.amin() >= 0):  # NaN compares False
        return False
    sums = v.sum(-1, dtype=torch.float64)  # a NaN or an infinity in a row makes its sum no 1
    return bool(((sums - 1.0).abs() <= 1e-3).all())


def holds_probabilities(name: str, ref: torch.Tensor) -> bool:
    """Whether a single-value head holds a probability (a sigmoid's output, decided at 0.5), not a logit (decided at 0):
    its name says so (``prob``, ``proba``, ``probability``), or, unless its name says logit, every finite value of
    the reference lies in [0, 1] (a logit head that never goes negative would decide class 1 for every case). That guess
    never decides alone: freeze refuses a head whose name says neither and whose values lie in [0, 1], some strictly
    between (``vetting.Scan.unit_heads``), so the user names it."""
    if says_probability(name):
        return True
    finite = ref[torch.isfinite(ref)]
    return not says_logit(name) and finite.numel() > 0 and bool(((finite >= 0) & (finite <= 1)).all())


def sign_flips(ids: Sequence[str], kinds: Sequence[str], ref: torch.Tensor, trial: torch.Tensor, boundary_margin: float,
               margin_kind: str, max_listed: int = 1000, positions: Sequence[int] | None = None,
               probability: bool = False, tie_rule: str = "lowest_index", at: float = 0.0,
               labels: Sequence[int] | None = None) -> Decisions:
    """The decisions of a single-value head, judged as DecisionStats judges class scores: a sigmoid's logit z (class 1
    where z >= 0), or with ``probability`` its probability p (class 1 where p >= 0.5, the logit z = log(p / (1 - p))
    read from it). Its margin is |z| (the two-class logits 0 and z), or |p1 - p0| = |tanh(z / 2)| for a
    ``probability`` margin; constructed boundary cases are counted apart, real ones near the boundary too. Under
    ``tie_is_flip``, z = 0 exactly (p = 0.5) is a tie of the two classes, class -1, as ``labels_of`` marks a tie:
    a tie on one side only is a flip. ``ids``, ``kinds``: of each decision; ``positions``: per token, the position of
    each (the unit is then a token); ``at``: where a value that is no probability is decided (a regression's threshold:
    its margin is then |value - at|); ``labels``: per case, the label its value is (a multi-label head's), named in each
    flip as its position, the unit still the case."""
    r, t = ref.detach().double().reshape(-1), trial.detach().double().reshape(-1)
    zr, zt = (torch.logit(v.clamp(0.0, 1.0)) if probability else v - at for v in (r, t))
    r_margin, t_margin = (torch.tanh(v / 2).abs() if margin_kind == "probability" else v.abs() for v in (zr, zt))
    constructed = torch.tensor([k == "boundary" for k in kinds], dtype=torch.bool)
    cr, ct = ((z >= 0).long() for z in (zr, zt))
    if tie_rule == "tie_is_flip":
        cr, ct = (torch.where(z == 0, torch.full_like(c, -1), c) for z, c in ((zr, cr), (zt, ct)))
    crossed = cr != ct
    near = (r_margin < boundary_margin) & ~constructed
    # A selected copy whose twin is here (``twins``): one input, so its case, its flip, its near case are its twin's.
    again, repeat_flip, repeat_near = (torch.zeros_like(crossed) for _ in range(3))
    pairs = [(n, m) for n, m in twins(ids, positions).items() if kinds[n] == "selected"]
    if pairs:
        copy, twin = (torch.tensor(v, dtype=torch.long) for v in zip(*pairs))
        again[copy], repeat_flip[copy], repeat_near[copy] = True, crossed[twin], near[twin]
    listed = torch.nonzero(crossed).flatten().tolist()
    flips = tuple(Flip(id=ids[i], kind=kinds[i], boundary=bool(constructed[i]), near_boundary=bool(near[i]),
                       reference_class=int(cr[i]), trial_class=int(ct[i]), reference_margin=float(r_margin[i]),
                       trial_margin=float(t_margin[i]), margin_kind=margin_kind, reference=float(r[i]), trial=float(t[i]),
                       position=int(positions[i]) if positions is not None else None if labels is None else int(labels[i]))
                  for i in listed[:max_listed])
    boundary_cases, boundary_flips = int(constructed.sum()), int((crossed & constructed).sum())
    sample, sample_flips = rate_sample(ids, kinds, crossed.long(), torch.ones(len(ids), dtype=torch.int64))
    counted = crossed & ~repeat_flip
    far, near_flips = int((counted & ~near & ~constructed).sum()), int((counted & near).sum())
    return Decisions(cases=len(ids) - int(again.sum()), boundary_cases=boundary_cases,
                     near_boundary_cases=int((near & ~repeat_near).sum()), flips=far,
                     near_boundary_flips=near_flips, boundary_flips=boundary_flips,
                     unit="case" if positions is None else "token", margin_kind=margin_kind,
                     boundary_margin=boundary_margin,
                     boundary_flip_fraction=boundary_flips / boundary_cases if boundary_cases else 0.0,
                     real_flips=far + near_flips, flip_list=flips, flip_list_dropped=max(len(listed) - max_listed, 0),
                     sample=sample, sample_flips=sample_flips)


def first_crossing(ref: torch.Tensor, trial: torch.Tensor, threshold: float, keep: torch.Tensor | None = None,
                   ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per case (rows of [N, K]): whether one of its values (where ``keep``) is on the other side of a regression's
    decision threshold in the trial (compared in float64), or, with ``ties`` (``tie_is_flip``), exactly at it on one
    side only, and the column of the first that is ([N, 1]; 0 where none)."""
    r, t = ref.double(), trial.double()
    crossed = (r >= threshold) != (t >= threshold)
    if ties:
        crossed |= (r == threshold) != (t == threshold)
    if keep is not None:
        crossed &= keep
    return crossed.any(1), crossed.to(torch.uint8).argmax(1, keepdim=True)


def regression_flips(ids: Sequence[str], kinds: Sequence[str], ref: torch.Tensor, trial: torch.Tensor, threshold: float | None,
                     boundary_margin: float = 0.0, margin_kind: str = "logit", probability: bool = False,
                     tie_rule: str = "lowest_index", max_listed: int = 1000,
                     labels: Sequence[int] | None = None) -> Decisions:
    """Cases one of whose values (``ref``, ``trial``: [N, ...]) crosses the decision threshold between reference and
    trial, judged as ``sign_flips`` judges a single-value head, at each case's first crossing value (else its first):
    at a sigmoid's boundary (0 for a logit, 0.5 for a ``probability``) with the head's margins, near the boundary or not;
    at a threshold of the user's by the distance |value - threshold|, in the output's units (margin kind ``value``).
    ``labels``: per case, the index of the value picked (a multi-label head's label), named in each flip."""
    if threshold is None or not ref.shape[0]:
        sample, sample_flips = rate_sample(ids, kinds, torch.zeros(len(ids), dtype=torch.int64),
                                           torch.ones(len(ids), dtype=torch.int64))
        return Decisions(cases=len(ids), boundary_cases=0, near_boundary_cases=0, flips=0, near_boundary_flips=0,
                         boundary_flips=0, boundary_flip_fraction=0.0, real_flips=0, unit="case", flip_list=(),
                         flip_list_dropped=0, sample=sample, sample_flips=sample_flips)
    r = ref.detach().double().reshape(ref.shape[0], -1)
    t = trial.detach().double().reshape(trial.shape[0], -1)
    crossed, at = first_crossing(r, t, threshold, ties=tie_rule == "tie_is_flip")
    r_pick = r.gather(1, at)[:, 0]
    t_pick = torch.where(crossed, t.gather(1, at)[:, 0], r_pick)
    sigmoid = threshold == (0.5 if probability else 0.0)
    if labels is None and r.shape[1] > 1:
        labels = at[:, 0].tolist()
    return sign_flips(ids, kinds, r_pick, t_pick, boundary_margin, margin_kind if sigmoid else "value", max_listed,
                      probability=probability and sigmoid, tie_rule=tie_rule, at=0.0 if sigmoid else threshold,
                      labels=labels)
