"""Speculation accuracy carried over between requests: the prior of OS3's Beta posterior.

A request of 128 tokens verifies about 32 documents, and the Beta posterior of the
``bayes`` estimate (:mod:`ralm.stride.os3`) starts each request from Beta(1, 1): its cautious
quantile stays low for most of the request, so the stride stays short. Measured at 4M rows
(int8 scan): the posterior reached 0.88 only after 17 windows, while the accuracy with
prefetching was 0.97, and PSA ran 1.40x where a fixed stride of 16 ran 2.14x.

Requests to the same knowledge base with the same speculation settings have about the
same accuracy, so a process keeps, per key, the (matched steps, mismatches) of its last
:data:`~ralm.constants.GAMMA_PRIOR_REQUESTS` requests, and a new request starts from
them scaled down to at most :data:`~ralm.constants.GAMMA_PRIOR_WEIGHT` pseudo-observations:
strong enough to start with long strides, weak enough that a request whose guesses keep
failing pulls its own estimate down within a few windows.

Worked example (weight 32): the last requests matched 150 steps and missed 6; scaled by
32 / 156 that is 31 matched and 1 missed (rounded), so a new request's posterior starts at
Beta(1 + 31, 1 + 1), whose 0.3 quantile is 0.93.

The same requests also measured what a speculative step and a verification of each batch
size cost on this KB. A new request starts with those too (the mean speculative step of
the last requests and, per batch size, the mean KB call), instead of estimating the step
from its first generation step (which includes the question's prefill: 67 ms where later
steps took 40 ms) and knowing b(s) for s = 1 only. Its own measurements join them and,
being more recent, soon dominate (the scheduler keeps at most 8 per size and 16 steps).

With the ``positional`` estimate (:mod:`ralm.stride.position_gamma`), the same evidence is also kept
per position bucket, each bucket scaled to at most the same weight.

Only strides depend on it; outputs never do (every speculated step is still verified).
Each process (a coordinator actor, an in-process pipeline) has its own prior.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable

from ralm import constants as C
from ralm.stride.beta_posterior import pseudo_observations
from ralm.stride.position_gamma import scaled


class GammaPrior:
    """Per key, the verification evidence of recent requests (thread-safe)."""

    def __init__(self, requests: int = C.GAMMA_PRIOR_REQUESTS, weight: int = C.GAMMA_PRIOR_WEIGHT):
        if requests < 1 or weight < 0:
            raise ValueError("requests must be >= 1 and weight >= 0")
        self.requests = int(requests)
        self.weight = int(weight)
        self._lock = threading.Lock()
        self._by_key: dict[Hashable, deque[tuple[int, int]]] = {}
        self._step_s: dict[Hashable, deque[float]] = {}  # key -> mean speculative step of recent requests
        self._verify_s: dict[Hashable, dict[int, deque[float]]] = {}  # key -> batch size -> recent means
        # key -> recent requests' realized (seconds, committed steps) in windows and in direct steps
        self._realized: dict[Hashable, deque[tuple[float, int, float, int]]] = {}
        # key -> recent requests' {position bucket: (matched, missed)}
        self._by_position: dict[Hashable, deque[dict[int, tuple[int, int]]]] = {}
        # key -> recent requests' mean overlap ratio (OS3's overlap check, ralm.stride.os3)
        self._overlap: dict[Hashable, deque[float]] = {}

    def evidence(self, key: Hashable) -> tuple[int, int]:
        """(matched, missed) pseudo-observations for a new request under ``key``: the recent
        requests' totals scaled to at most ``weight`` (rounded); (0, 0) when none."""
        with self._lock:
            recent = list(self._by_key.get(key, ()))
        return pseudo_observations(sum(x for x, _ in recent), sum(y for _, y in recent), self.weight)

    def position_evidence(self, key: Hashable) -> dict[int, tuple[int, int]]:
        """{position bucket: (matched, missed)} of the recent requests under ``key``, each
        bucket scaled to at most ``weight`` (see :func:`ralm.stride.position_gamma.scaled`)."""
        with self._lock:
            recent = list(self._by_position.get(key, ()))
        return scaled(((b, m, f) for counts in recent for b, (m, f) in counts.items()), self.weight)

    def latencies(self, key: Hashable) -> tuple[float | None, dict[int, float]]:
        """(mean speculative step in s or None, {batch size: mean KB call in s}) of the recent
        requests under ``key``."""
        with self._lock:
            steps = list(self._step_s.get(key, ()))
            by_size = {s: list(v) for s, v in self._verify_s.get(key, {}).items()}
        step = sum(steps) / len(steps) if steps else None
        return step, {s: sum(v) / len(v) for s, v in sorted(by_size.items()) if v}

    def realized(self, key: Hashable) -> tuple[float, int, float, int]:
        """(seconds, committed steps) spent in speculation windows, then in direct steps,
        summed over the recent requests under ``key`` (zeros when none)."""
        with self._lock:
            recent = list(self._realized.get(key, ()))
        if not recent:
            return 0.0, 0, 0.0, 0
        ws, wn, ds, dn = map(sum, zip(*recent))
        return ws, wn, ds, dn

    def overlap(self, key: Hashable) -> list[float]:
        """The recent requests' mean overlap ratios under ``key`` (one each, oldest first)."""
        with self._lock:
            return list(self._overlap.get(key, ()))

    def record(
        self,
        key: Hashable,
        matched: int,
        missed: int,
        step_s: float | None = None,
        verify_s: dict[int, float] | None = None,
        realized: tuple[float, int, float, int] | None = None,
        by_position: dict[int, tuple[int, int]] | None = None,
        overlap: float | None = None,
    ) -> None:
        """A finished request's own evidence (not including the prior it started from) and,
        if given, its mean speculative step and mean KB call per batch size (seconds), and
        its realized (seconds, committed steps) in windows and in direct steps, and its
        evidence per position bucket, and its mean overlap ratio."""
        if matched < 0 or missed < 0:
            raise ValueError("evidence counts must be >= 0")
        with self._lock:
            if realized is not None and (realized[1] or realized[3]):
                self._realized.setdefault(key, deque(maxlen=self.requests)).append(realized)
            if matched + missed:
                self._by_key.setdefault(key, deque(maxlen=self.requests)).append((int(matched), int(missed)))
            if by_position:
                self._by_position.setdefault(key, deque(maxlen=self.requests)).append(dict(by_position))
            if overlap is not None and overlap > 0:
                self._overlap.setdefault(key, deque(maxlen=self.requests)).append(float(overlap))
            if step_s is not None and step_s > 0:
                self._step_s.setdefault(key, deque(maxlen=self.requests)).append(float(step_s))
            sizes = self._verify_s.setdefault(key, {})
            for size, lat in (verify_s or {}).items():
                if lat > 0:
                    sizes.setdefault(int(size), deque(maxlen=self.requests)).append(float(lat))

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
            self._step_s.clear()
            self._verify_s.clear()
            self._realized.clear()
            self._by_position.clear()
            self._overlap.clear()


PROCESS_PRIOR = GammaPrior()  # the prior every request of this process shares
