"""Exact statistical bounds of the rule, in plain Python (torch-free: decide imports it).

"At most x % of decisions change" is a claim about the application's inputs, not about the fixed set: on n
independent draws (the ordinary cases) with k changed decisions, the rate's exact (Clopper–Pearson) upper bound at a
confidence is what such a criterion tests, and a quality drop is bounded PAIRED over the same cases (McNemar's view). A small
set then cannot give a confident accept, and a large one does not roll back on noise.
"""

from __future__ import annotations

import math


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (exact to float64 rounding)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def binomial_upper(k: int, n: int, confidence: float) -> float:
    """Clopper–Pearson (exact) one-sided upper bound of a rate from ``k`` events in ``n`` trials: the largest p
    with P(X <= k | n, p) >= 1 - confidence. 1.0 when n is 0 (nothing measured bounds nothing)."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    alpha = 1.0 - confidence
    if k == 0:
        return 1.0 - alpha ** (1.0 / n)
    lo, hi = k / n, 1.0
    for _ in range(100):  # bisection: the CDF falls as p grows
        mid = 0.5 * (lo + hi)
        if _binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def cases_needed(max_rate: float, confidence: float) -> int:
    """Fewest cases on which 0 events give an upper bound at or below ``max_rate``: below that, no set can pass."""
    if max_rate <= 0.0:
        return math.inf
    if max_rate >= 1.0:
        return 0
    return math.ceil(math.log(1.0 - confidence) / math.log1p(-max_rate))


def paired_drop_upper(lost: int, gained: int, n: int, confidence: float) -> float:
    """Upper bound of a quality drop measured PAIRED over the same ``n`` cases: ``lost`` cases the reference got
    right and the trial wrong, ``gained`` the reverse (McNemar's view). Given the d = lost + gained discordant
    cases, lost ~ Binomial(d, pi) and the drop is d (2 pi - 1) / n: bounded through pi's exact upper bound."""
    if n <= 0:
        return math.inf
    d = lost + gained
    if d == 0:
        return 0.0
    return d * (2.0 * binomial_upper(lost, d, confidence) - 1.0) / n
