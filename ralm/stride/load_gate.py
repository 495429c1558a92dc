"""Direct steps while many requests share the knowledge base's batches.

On a KB that batches the calls of all requests in flight (the served verifier,
:class:`~ralm.retrieval.base.SharedKB`), RaLMSeq's requests fall into step: each search carries
one query of every request, at little more than the cost of one. Speculation then saves no KB
work: every step is still verified, so the number of queries stays the same, and windows
that end at different times break the lock-step. It only adds its own work (query encodings
and cache lookups, rolled-back steps) on a machine that is already saturated. Measured with the
int8 scan at 4M rows, 16 requests in flight on 2 cores: PSA 0.78-0.83x served RaLMSeq, its
KB busy 70% of the wall time against 48% for RaLMSeq (docs/results, section 7).

So, like serving engines that turn speculative decoding off above a batch size, RaLMSpec takes
direct steps while at least ``SpecConfig.shared_kb_direct_at`` requests share the KB (the
count the KB reported with its last answer), and speculates again when the load falls. Those
direct steps are RaLMSeq's own, without the cache work of OS3's direct steps (no probe, no
insertion into the cache; the next verification's prefetch fills it again). The gate only
chooses strides: a direct step is the baseline's own step, so outputs never change.
"""

from __future__ import annotations

from typing import Any

from ralm.retrieval.base import SharedKB


class SharedLoadGate:
    """A stride scheduler that answers 0 (a direct step) while the shared KB is crowded and
    otherwise asks ``sched``; every other call goes to ``sched`` unchanged.

    >>> class Sched:
    ...     gamma = 0.9
    ...     def next_stride(self, position=None, remaining=None):
    ...         return 8
    >>> class KB:
    ...     load = 3
    ...     def speculating(self): pass
    ...     def sharing(self): return self.load
    >>> kb = KB()
    >>> gate = SharedLoadGate(Sched(), kb, threshold=8)
    >>> gate.next_stride(), gate.gamma
    (8, 0.9)
    >>> kb.load = 12
    >>> gate.next_stride(), gate.gated
    (0, 1)
    """

    def __init__(self, sched: Any, kb: Any, threshold: int):
        self.sched = sched
        self.kb = kb if isinstance(kb, SharedKB) else None
        self.threshold = int(threshold)
        self.gated = 0  # decisions turned into direct steps by the load
        self.gating = False  # the last decision was one of them

    def crowded(self) -> bool:
        """At least ``threshold`` requests share the KB (never when the KB is not shared)."""
        return self.kb is not None and self.threshold > 0 and self.kb.sharing() >= self.threshold

    def next_stride(self, position: int | None = None, remaining: int | None = None) -> int:
        self.gating = self.crowded()
        if self.gating:
            self.gated += 1
            return 0
        return self.sched.next_stride(position=position, remaining=remaining)

    def __getattr__(self, name: str) -> Any:  # record_*, gamma, finish, ...: the scheduler's own
        return getattr(self.sched, name)
