"""The ranking primitives shared by every retriever, shard, cache and verifier.

A *hit* is ``(doc_id, score)`` where ``doc_id`` is the passage's integer position in
the corpus (its row number) and ``score`` a Python float. Every ranking in ralmspec
orders hits by **score descending, then doc id ascending**, so two rankers that
compute the same scores return the same list.

An :class:`ExactScorer` is a pure float64 function of (query, document key). The KB
retrievers re-score their candidates with it and the local speculative caches rank
with the very same scorer, so when the KB's top-1 document is in the cache, the
cache's top-1 is that document, bit for bit.

These live at the bottom layer (``cache``) so that the caches need nothing from
``ralm``; :mod:`ralm.retrieval.base` re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Hit = tuple[int, float]


def rank_hits(doc_ids: np.ndarray | Sequence[int], scores: np.ndarray | Sequence[float], k: int) -> list[Hit]:
    """Top-``k`` of ``(doc_ids, scores)`` ordered by (score desc, doc id asc).

    Example: ids [7, 3, 5], scores [0.5, 0.9, 0.5], k=2 -> [(3, 0.9), (5, 0.5)]
    (5 beats 7 on the tie because its id is lower).
    Duplicate ids are kept once (the first occurrence's score wins; callers pass
    scores that agree for duplicates).
    """
    ids = np.asarray(doc_ids, dtype=np.int64)
    sc = np.asarray(scores, dtype=np.float64)
    if ids.shape != sc.shape:
        raise ValueError(f"doc_ids {ids.shape} and scores {sc.shape} differ in shape")
    if ids.size == 0 or k <= 0:
        return []
    ids, first = np.unique(ids, return_index=True)
    sc = sc[first]
    order = np.lexsort((ids, -sc))[:k]  # last key is primary: -score, then id
    return [(int(ids[i]), float(sc[i])) for i in order]


@runtime_checkable
class ExactScorer(Protocol):
    """The exact scoring function of a KB, shared by the KB re-ranker and the caches."""

    def encode(self, queries: Sequence[str]) -> list[Any]:
        """Query representations (a float32 vector for dense, term counts for BM25)."""

    def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        """The per-document keys the scorer needs (vectors, or term statistics)."""

    def score(self, query_rep: Any, keys: Sequence[Any]) -> np.ndarray:
        """float64 scores of one query against ``keys``; a pure function."""
