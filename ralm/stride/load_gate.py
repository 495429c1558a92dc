"""Direct steps while other requests share the knowledge base's batches.

On a KB that batches the calls of all requests in flight (the served verifier,
:class:`~ralm.retrieval.base.SharedKB`), a request's query rides in a search that other
requests' queries already pay for. OS3's model (:mod:`ralm.stride.os3`) prices a KB call of
``s`` queries at ``b(s)``, as if the request were alone; speculation pays there because one
call of ``s`` queries costs much less than ``s`` calls of one. Under sharing, the fixed part
of a search is already paid by the others' queries, and a request's queries cost only what
they *add* to the search. With ``Q`` other queries per search (the verifier reports the
size of the search that answered each call) and the KB's batch cost curve ``c`` (cost of a
search of ``n`` queries relative to one query, :mod:`ralm.stride.batch_cost`; ``c(0) = 0``),
a step's cost, generation plus the KB work it adds:

- direct step:  ``W_direct = g + b1 (c(Q + 1) - c(Q))``
- window of s:  ``W_spec(s) = (s a + (1 - gamma^s) g + b1 (c(Q + s) - c(Q))) / E(s)``

with ``g`` a generation step, ``a`` a speculative step, ``b1`` one query alone and
``E(s) = (1 - gamma^s) / (1 - gamma)`` the steps a window commits. Alone (``Q = 0``) this is
OS3's own synchronous model. Where the curve is linear beyond ``Q`` (a compute-bound scan:
every query costs the same ``d``), ``W_spec(s) = (s a + (1-gamma^s) g + s d b1) / E(s) >= g + d b1``
because ``s >= E(s)`` and ``a >= g``: speculation does not reduce the number of queries, only the
number of calls, and under load it only adds work. So the rule takes a direct step when
``W_direct <= min_s W_spec(s)``, and leaves every other decision to OS3.

Worked example (the int8 scan at 4M rows, curve {1: 1.0, 4: 1.3, 16: 3.4}, b1 = 0.17 s,
g = a = 0.036 s, gamma = 0.9): alone, a window of 4 costs (0.144 + 0.012 + 0.22) / 3.44 =
0.109 s a step against 0.206 s direct: speculate. With 3 other queries per search,
c(4) - c(3) = 0.1 and c(7) - c(3) = 0.625: direct costs 0.036 + 0.017 = 0.053 s, the best
window 0.073 s: direct.

A hard backstop stays: at least ``SpecConfig.shared_kb_direct_at`` requests sharing the KB
(0: off) send every step direct, whatever the model says. Those direct steps are RaLMSeq's
own, without the cache work of OS3's direct steps (no probe, no insertion into the cache; the
next verification's prefetch fills it again). The gate only chooses strides: a direct step
is the baseline's own step, so outputs never change. Each decision's reason is counted
(:data:`REASONS`, ``RequestStats.stride_reasons``).
"""

from __future__ import annotations

from typing import Any

from ralm.retrieval.base import SharedKB
from ralm.stride.batch_cost import curve_at, monotone
from ralm.stride.os3 import expected_verified

REASONS = {
    "speculate": "OS3 chose a window (s >= 1)",
    "fixed": "a fixed stride (no scheduler)",
    "direct_model": "OS3's model: a direct step is faster than any window (cheap retrieval)",
    "direct_measured": "OS3's rate check: speculation measured slower than direct steps",
    "direct_shared": "the KB is shared: the queries a window adds cost more than the calls it saves",
    "direct_crowded": "at least shared_kb_direct_at requests share the KB (the backstop)",
}
"""Why a stride was chosen: the keys of ``RequestStats.stride_reasons``."""


def marginal_cost(curve: dict[int, float], others: float, s: int) -> float:
    """What ``s`` queries add to a search that carries ``others`` queries already, relative to
    one query alone: ``c(others + s) - c(others)``, with ``c(0) = 0`` (alone, a call's whole cost).

    >>> curve = {1: 1.0, 4: 1.3, 16: 3.4}
    >>> marginal_cost(curve, 0, 4), round(marginal_cost(curve, 3, 1), 9), round(marginal_cost(curve, 3, 4), 9)
    (1.3, 0.1, 0.625)
    """
    c = monotone({0: 0.0, **curve})
    return curve_at(c, others + s) - curve_at(c, others)


def shared_step_costs(
    gamma: float, a: float, g: float, b1: float, curve: dict[int, float], others: float, max_stride: int
) -> tuple[float, float, int]:
    """``(W_direct, min_s W_spec(s), that s)``: seconds of work per committed step (module docstring).

    >>> d, w, s = shared_step_costs(0.9, 0.036, 0.036, 0.17, {1: 1.0, 4: 1.3, 16: 3.4}, 3, 8)
    >>> round(d, 3), d < w
    (0.053, True)
    >>> d, w, s = shared_step_costs(0.9, 0.036, 0.036, 0.17, {1: 1.0, 4: 1.3, 16: 3.4}, 0, 8)
    >>> round(d, 3), w < d, s > 1
    (0.206, True, True)
    """
    direct = g + b1 * marginal_cost(curve, others, 1)
    best, best_s = float("inf"), 1
    for s in range(1, max_stride + 1):
        w = (s * a + (1 - gamma**s) * g + b1 * marginal_cost(curve, others, s)) / expected_verified(gamma, s)
        if w < best:
            best, best_s = w, s
    return direct, best, best_s


class SharedLoadGate:
    """A stride scheduler that answers 0 (a direct step) while the shared KB makes a window
    dearer than a direct step, or is crowded, and otherwise asks ``sched``; every other call
    goes to ``sched`` unchanged. ``reasons`` counts each decision's reason (:data:`REASONS`).

    >>> class Sched:
    ...     gamma, cfg, decisions = 0.9, None, [8]
    ...     def next_stride(self, position=None, remaining=None):
    ...         return 8
    >>> class KB:
    ...     load, others = 3, 0.0
    ...     def speculating(self): pass
    ...     def sharing(self): return self.load
    ...     def others_per_search(self): return self.others
    >>> kb = KB()
    >>> gate = SharedLoadGate(Sched(), kb, threshold=8)
    >>> gate.next_stride(), gate.gamma
    (8, 0.9)
    >>> kb.load = 12
    >>> gate.next_stride(), gate.gated, gate.reasons
    (0, 1, {'speculate': 1, 'direct_crowded': 1})
    """

    def __init__(self, sched: Any, kb: Any, threshold: int, cost_model: bool = True):
        self.sched = sched
        self.kb = kb if isinstance(kb, SharedKB) else None
        self.threshold = int(threshold)
        self.cost_model = cost_model
        self.gated = 0  # decisions turned into direct steps by the load
        self.gating = False  # the last decision was one of them
        self.reasons: dict[str, int] = {}
        self.others = 0.0  # other requests' queries per search at the last decision

    def crowded(self) -> bool:
        """At least ``threshold`` requests share the KB (never when the KB is not shared)."""
        return self.kb is not None and self.threshold > 0 and self.kb.sharing() >= self.threshold

    def shared_direct(self) -> bool:
        """The cost model's answer (module docstring): under sharing, is a direct step cheaper
        than the best window? False while something it needs is not measured yet."""
        if self.kb is None or not self.cost_model:
            return False
        self.others = float(self.kb.others_per_search() or 0.0)
        sched = self.sched
        curve = getattr(sched, "cost_curve", None)
        if self.others < 0.5 or not curve:
            return False
        a, b1, g = sched.step_latency(), sched.verify_latency(1), sched.generation_latency()
        if a is None or b1 is None or g is None:
            return False
        gamma = sched.gamma if sched.gamma is not None else sched.optimistic_gamma()
        direct, spec, _ = shared_step_costs(gamma, a, g, b1, curve, self.others, sched.cfg.max_stride)
        return direct <= spec

    def _count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def next_stride(self, position: int | None = None, remaining: int | None = None) -> int:
        reason = "direct_crowded" if self.crowded() else "direct_shared" if self.shared_direct() else ""
        self.gating = bool(reason)
        if self.gating:
            self.gated += 1
            self._count(reason)
            return 0
        vetoes = getattr(self.sched, "vetoes", 0)
        s = self.sched.next_stride(position=position, remaining=remaining)
        self._count(reason_of(self.sched, s, vetoed=getattr(self.sched, "vetoes", 0) > vetoes))
        return s

    def __getattr__(self, name: str) -> Any:  # record_*, gamma, finish, ...: the scheduler's own
        return getattr(self.sched, name)


def reason_of(sched: Any, s: int, vetoed: bool = False) -> str:
    """The reason of OS3's own decision ``s``: a window, a fixed stride, or a direct step from
    its model or (``vetoed``) from its rate check."""
    cfg = getattr(sched, "cfg", None)
    if cfg is not None and not cfg.adaptive_stride:
        return "fixed"
    if s > 0:
        return "speculate"
    return "direct_measured" if vetoed else "direct_model"
