"""The Beta posterior of the speculation accuracy: CDF and quantiles for integer parameters,
and the scaling of borrowed evidence into pseudo-observations.

OS3's default estimates (:mod:`ralm.os3`, :mod:`ralm.position_gamma`) read verified windows
as Bernoulli evidence and use a lower quantile of Beta(1 + matches, 1 + mismatches).
"""

from __future__ import annotations

import functools
import math


def beta_cdf_int(x: float, a: int, b: int) -> float:
    """I_x(a, b) for integer a, b >= 1: P(Binomial(a + b - 1, x) >= a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    n = a + b - 1
    lx, l1x = math.log(x), math.log1p(-x)
    return min(
        1.0,
        sum(
            math.exp(math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lx + (n - j) * l1x)
            for j in range(a, n + 1)
        ),
    )


@functools.lru_cache(maxsize=4096)
def beta_quantile_int(q: float, a: int, b: int) -> float:
    """The ``q`` quantile of Beta(a, b), integer a, b >= 1 (bisection to 1e-9). Memoised:
    a decision is taken every step, and in a run of direct steps the evidence, hence
    (q, a, b), rarely changes (a bisection costs about 0.1 ms).

    >>> round(beta_quantile_int(0.3, 2, 1), 4)  # CDF x^2: sqrt(0.3)
    0.5477
    """
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if beta_cdf_int(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
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
