"""The Beta posterior of the speculation accuracy: CDF and quantiles for integer parameters,
and the scaling of borrowed evidence into pseudo-observations.

OS3's default estimates (:mod:`ralm.stride.os3`, :mod:`ralm.stride.position_gamma`) read verified windows
as Bernoulli evidence and use a lower quantile of Beta(1 + matches, 1 + mismatches).
"""

from __future__ import annotations

import functools
import math


def _binomial_pmf(j: int, n: int, lx: float, l1x: float) -> float:
    return math.exp(math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lx + (n - j) * l1x)


def beta_cdf_int(x: float, a: int, b: int) -> float:
    """I_x(a, b) for integer a, b >= 1: P(Binomial(a + b - 1, x) >= a).

    Summed over the binomial tail that falls away from the mode ``n x`` (each term from the
    last by one multiplication): the upper tail from ``a`` when ``a`` is above the mode,
    else one minus the lower tail below ``a``. Either way the first term is the largest, so
    a first term too small for a float means a tail that small.

    >>> round(beta_cdf_int(0.5, 2, 1), 6), round(beta_cdf_int(0.9, 1, 3), 6)  # x^2, 1 - (1 - x)^3
    (0.25, 0.999)
    """
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    n = a + b - 1
    lx, l1x = math.log(x), math.log1p(-x)
    odds = x / (1.0 - x)
    if a > n * x:  # upper tail a..n, terms falling
        term = total = _binomial_pmf(a, n, lx, l1x)
        for j in range(a, n):
            term *= (n - j) / (j + 1) * odds
            total += term
        return min(1.0, total)
    term = total = _binomial_pmf(a - 1, n, lx, l1x)  # lower tail a-1..0, terms falling
    for j in range(a - 1, 0, -1):
        term *= j / ((n - j + 1) * odds)
        total += term
    return max(0.0, 1.0 - total)


@functools.lru_cache(maxsize=4096)
def beta_quantile_int(q: float, a: int, b: int) -> float:
    """The ``q`` quantile of Beta(a, b), integer a, b >= 1 (to 1e-9, by regula falsi with the
    Illinois step). Memoised: a decision is taken every step,
    and in a run of direct steps the evidence, hence (q, a, b), rarely changes.

    >>> round(beta_quantile_int(0.3, 2, 1), 4)  # CDF x^2: sqrt(0.3)
    0.5477
    """
    lo, hi = 0.0, 1.0
    f_lo, f_hi = -q, 1.0 - q  # CDF - q at the bracket's ends
    last = 0  # which end moved last (-1: lo, 1: hi)
    while hi - lo > 1e-9:
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not lo < x < hi:
            x = (lo + hi) / 2
        f = beta_cdf_int(x, a, b) - q
        if f == 0.0:
            return x
        if f < 0:
            if last == -1:
                f_hi /= 2  # Illinois: the end that stays put counts half, so the other moves too
            lo, f_lo, last = x, f, -1
        else:
            if last == 1:
                f_lo /= 2
            hi, f_hi, last = x, f, 1
        if abs(f) < 1e-13:  # as close as the CDF's own rounding
            return x
    return (lo + hi) / 2


def pseudo_observations(matched: int, missed: int, weight: int) -> tuple[int, int]:
    """(matched, missed) scaled down to at most ``weight`` observations in all (rounded);
    (0, 0) when there are none. How evidence from elsewhere (earlier requests, other
    position buckets) enters a posterior without outweighing the request's own.

    >>> pseudo_observations(150, 6, 32)
    (31, 1)
    """
    n = matched + missed
    if n == 0:
        return 0, 0
    k = min(1.0, weight / n)
    return round(matched * k), round(missed * k)
