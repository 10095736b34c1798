"""Exact statistical bounds of the rule, in plain Python (torch-free: decide imports it).

"At most x % of decisions change" is a claim about the application's inputs, not about the fixed set: on n
independent draws (the ordinary cases) with k changed decisions, the rate's exact (Clopper–Pearson) upper bound at a
confidence is what such a criterion tests, and a quality drop is bounded PAIRED over the same cases (McNemar's view). A small
set then cannot give a confident accept, and a large one does not roll back on noise.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=64)
def student_t_quantile(confidence: float, df: int) -> float:
    """The one-sided ``confidence`` quantile of Student's t with ``df`` degrees of freedom (closed forms for 1 and 2,
    else bisection on the CDF, integrated from the density by Simpson's rule: float64 to about 1e-10)."""
    if df < 1:
        return math.inf
    if df == 1:
        return math.tan(math.pi * (confidence - 0.5))
    if df == 2:
        a = 2.0 * confidence - 1.0
        return a * math.sqrt(2.0 / (1.0 - a * a))
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, steps: int = 2000) -> float:  # 0.5 + the integral of the density over [0, x]
        h = x / steps
        f = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 64.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < confidence else (lo, mid)
    return hi


def fp32_drop_allowed(reference: float, replicates: list[float], confidence: float, higher_is_better: bool = True) -> float:
    """How far below the ``reference``'s quality an (n+1)-th FP32 training may land, at ``confidence``: the one-sided
    prediction bound of a new draw from the n FP32 runs (the reference and its ``replicates``), mean - t s sqrt(1 + 1/n),
    as a drop from the reference (>= 0). A trial trained as FP32 would be falls below it with probability 1 - confidence
    (FP32 runs' qualities normal): the false-rollback rate of a criterion judged against FP32's own spread. Two runs
    give t with 1 degree of freedom (6.31 at 0.95): one replicate only says how far FP32 wanders, roughly."""
    runs = [reference, *replicates]
    if len(runs) < 2 or not all(math.isfinite(v) for v in runs):
        return 0.0
    sign = 1.0 if higher_is_better else -1.0
    values = [sign * v for v in runs]
    n, mean = len(values), sum(values) / len(values)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    lower = mean - student_t_quantile(confidence, n - 1) * s * math.sqrt(1.0 + 1.0 / n)
    return max(0.0, values[0] - lower)
