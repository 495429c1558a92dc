"""The retriever protocol shared by every backend, shard, cache and verifier.

A *hit* is ``(doc_id, score)`` where ``doc_id`` is the passage's integer position in
the corpus (its row number) and ``score`` a Python float. Every ranking in ralmspec
orders hits by **score descending, then doc id ascending**, so two rankers that
compute the same scores return the same list. :data:`Hit`, :func:`rank_hits` and
:class:`ExactScorer` are defined in :mod:`cache.ranking` (the bottom layer, so that the
caches need nothing from ``ralm``) and re-exported here.

Exactness design: every KB retriever is a *candidate generator* (FAISS or Lucene)
followed by an *exact re-scoring* with an :class:`ExactScorer` - a pure float64
function of (query, document key). The local speculative caches rank with the very
same scorer, so when the KB's top-1 document is in the cache, the cache's top-1 is
that document, bit for bit. The re-scoring also makes a query's result independent
of the batch it arrives in (FAISS uses a different kernel for batches >= 20).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cache.ranking import ExactScorer, Hit, rank_hits

__all__ = ["ExactScorer", "Hit", "Retriever", "SharedKB", "rank_hits"]


@runtime_checkable
class Retriever(Protocol):
    """What every backend (EDR, ADR, SR, a sharded router, a cache) provides."""

    name: str
    scorer: ExactScorer

    def search(self, query: str, k: int) -> list[Hit]:
        """Top-``k`` hits for one query."""

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Top-``k`` hits for each query; equal to calling :meth:`search` on each."""


@runtime_checkable
class SharedKB(Protocol):
    """A KB that batches the calls of several requests (the served verifier).

    :meth:`speculating` is a scheduling hint, never a change of result: the caller's request
    has opened a speculation window and makes no KB call until that window's verification,
    so a batch forming now need not wait for it. :meth:`sharing` says how many requests share
    the KB and :meth:`others_per_search` what its searches carry besides this request's queries
    (RaLMSpec takes direct steps where sharing makes them cheaper, :mod:`ralm.stride.load_gate`).
    """

    def speculating(self) -> None:
        """The request in flight runs speculative steps until its next KB call."""

    def sharing(self) -> int:
        """Requests that shared the KB's batches at its last answer (this one included; 0:
        not known yet)."""

    def others_per_search(self) -> float | None:
        """Other requests' queries in the searches that answered this request's recent calls
        (None: not known yet); the stride scheduler prices its own queries by what they add."""
