"""OS3: the optimal speculation stride scheduler (RaLMSpec paper, section 4 and appendix A.2).

Let ``a`` be the latency of a speculative step, ``b(s)`` that of a verification of batch
size ``s`` and ``gamma`` the speculation accuracy. The expected number of documents a
window of ``s`` verifies is ``(1 - gamma^s) / (1 - gamma)``. OS3 picks the ``s`` that
maximises verified documents per second:

- synchronous:  (1-g^s) / ((1-g) (s a + b))
- asynchronous: (1-g^s) / ((1-g) [g^s ((s-1) a + max(a, b)) + (1-g^s)(s a + b)])

Worked example (synchronous, a = 10 ms, b = 40 ms, gamma = 0.6):
s=1: 1/50 = 0.0200, s=2: 1.6/60 = 0.0267, s=3: 1.96/70 = 0.0280, s=4: 2.18/80 = 0.0272
(each divided by 1-g=0.4, which does not change the argmax) -> s = 3.

gamma is estimated over the last ``w`` verifications as sum(M) / (sum(M) + sum(1[M < s]))
(M = matched steps of a window of size s), capped at ``gamma_max``.
"""
from __future__ import annotations

from collections import deque
from statistics import fmean

from ralm.config import SpecConfig


def expected_verified(gamma: float, s: int) -> float:
    """(1 - gamma^s) / (1 - gamma): expected documents verified by a window of ``s``."""
    if gamma >= 1.0:
        return float(s)
    return (1.0 - gamma**s) / (1.0 - gamma)


def objective(s: int, gamma: float, a: float, b: float, asynchronous: bool) -> float:
    """Expected verified documents per second for stride ``s`` (a, b in seconds)."""
    gs = gamma**s
    if asynchronous:
        latency = gs * ((s - 1) * a + max(a, b)) + (1 - gs) * (s * a + b)
    else:
        latency = s * a + b
    return expected_verified(gamma, s) / max(latency, 1e-12)


class StrideScheduler:
    """Chooses the speculation stride; fixed unless ``cfg.adaptive_stride`` (OS3)."""

    def __init__(self, cfg: SpecConfig, history: int = 16):
        self.cfg = cfg
        self._windows: deque[tuple[int, int]] = deque(maxlen=cfg.os3_window)   # (s, matched)
        self._step_lat: deque[float] = deque(maxlen=history)                    # seconds
        self._verify_lat: deque[tuple[int, float]] = deque(maxlen=history)     # (batch size, seconds)

    # ---- measurements
    def record_step(self, latency_s: float) -> None:
        self._step_lat.append(latency_s)

    def record_verification(self, s: int, matched: int, latency_s: float) -> None:
        self._windows.append((s, matched))
        self._verify_lat.append((s, latency_s))

    # ---- estimates
    @property
    def gamma(self) -> float | None:
        """Capped maximum-likelihood estimate of the speculation accuracy, or None."""
        if not self._windows:
            return None
        m = sum(mt for _, mt in self._windows)
        fails = sum(1 for s, mt in self._windows if mt < s)
        if m + fails == 0:
            return 0.0
        return min(m / (m + fails), self.cfg.gamma_max)

    def step_latency(self) -> float | None:
        return fmean(self._step_lat) if self._step_lat else None

    def verify_latency(self, s: int) -> float | None:
        """b(s): least-squares line over recent (s, latency) when several sizes were seen,
        else their mean. Slope and intercept are clamped at zero."""
        if not self._verify_lat:
            return None
        xs = [float(x) for x, _ in self._verify_lat]
        ys = [y for _, y in self._verify_lat]
        if len(set(xs)) < 2:
            return fmean(ys)
        mx, my = fmean(xs), fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        intercept = max(0.0, my - slope * mx)
        return intercept + slope * s

    # ---- decision
    def next_stride(self) -> int:
        cfg = self.cfg
        if not cfg.adaptive_stride:
            return cfg.stride
        g, a = self.gamma, self.step_latency()
        if g is None or a is None or not self._verify_lat:
            return 1                     # start at s = 1 until there is something to estimate
        best_s, best = 1, -1.0
        for s in range(1, cfg.max_stride + 1):
            val = objective(s, g, a, self.verify_latency(s), cfg.async_verify)
            if val > best * (1 + 1e-9):
                best_s, best = s, val
        return best_s
