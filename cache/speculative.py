"""The per-request local speculative cache (RaLMSpec's local cache).

A small store of documents and their keys, ranked with **the KB's own exact scorer**
(:class:`~cache.ranking.ExactScorer`) and :func:`~cache.ranking.rank_hits`.
Consequently, whenever the KB's top-1 document for a query is in the cache, the
cache's top-1 is that same document with the bit-identical score, and more generally
``cache.search(q, k)`` equals the KB ranking restricted to the cached documents.

Dense keys (1-D vectors) are kept stacked in a growing float64 matrix (float32 ->
float64 is exact, so the scores are the same as from the float32 keys), which is
passed to ``scorer.score`` as one array; other keys (BM25 term statistics) are kept
in a list.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from cache.ranking import ExactScorer, Hit, rank_hits


class SpeculativeCache:
    """Local cache of KB documents for one request.

    ``add(doc_ids)`` accepts doc ids or hits ``(doc_id, score)`` (e.g. a KB result).
    """

    def __init__(self, scorer: ExactScorer, capacity: int | None = None):
        self.scorer = scorer
        self.capacity = capacity
        self._lock = threading.Lock()
        self.lookups = 0
        self.inserts = 0
        self.duplicates = 0
        self._reset()

    def _reset(self) -> None:
        self._ids: list[int] = []
        self._pos: dict[int, int] = {}
        self._keys: list[Any] = []
        self._mat: np.ndarray | None = None  # dense mode: (capacity, dim) float64
        self._dense: bool | None = None

    # ---------------------------------------------------------------- content
    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, doc_id: object) -> bool:
        try:
            # any int-like id is looked up; other objects are caught below
            return int(doc_id) in self._pos  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False

    @property
    def doc_ids(self) -> list[int]:
        """Cached doc ids, in insertion order."""
        return list(self._ids)

    def clear(self) -> None:
        with self._lock:
            self._reset()

    @staticmethod
    def _as_id(x: Any) -> int:
        if isinstance(x, (tuple, list)):
            x = x[0]
        return int(x)

    def add(self, doc_ids: Iterable[int] | Iterable[Hit]) -> int:
        """Insert documents not yet cached (their keys come from ``scorer.doc_keys``).

        Returns the number of documents inserted.
        """
        wanted: list[int] = []
        seen: set[int] = set()
        for x in doc_ids:
            d = self._as_id(x)
            if d in self._pos or d in seen:
                self.duplicates += 1
                continue
            seen.add(d)
            wanted.append(d)
        if not wanted:
            return 0
        keys = self.scorer.doc_keys(wanted)
        with self._lock:
            n_added = 0
            for d, key in zip(wanted, keys):
                if d in self._pos:
                    continue
                if self.capacity is not None and len(self._ids) >= self.capacity:
                    break
                self._append(d, key)
                n_added += 1
            self.inserts += n_added
        return n_added

    def _append(self, doc_id: int, key: Any) -> None:
        if self._dense is None:
            self._dense = isinstance(key, np.ndarray) and key.ndim == 1
        n = len(self._ids)
        if self._dense:
            vec = np.asarray(key, dtype=np.float64)
            if self._mat is None:
                self._mat = np.empty((16, vec.shape[0]), dtype=np.float64)
            elif n == self._mat.shape[0]:
                grown = np.empty((2 * n, self._mat.shape[1]), dtype=np.float64)
                grown[:n] = self._mat[:n]
                self._mat = grown
            self._mat[n] = vec
        else:
            self._keys.append(key)
        self._pos[doc_id] = n
        self._ids.append(doc_id)

    # ---------------------------------------------------------------- ranking
    def scores(self, query_rep: Any) -> tuple[np.ndarray, np.ndarray]:
        """(doc ids, exact scores) of every cached document, insertion order."""
        with self._lock:
            n = len(self._ids)
            ids = np.asarray(self._ids, dtype=np.int64)
            # dense mode: the stacked (n, dim) key matrix, which the dense scorer takes whole
            # (a 2-D array indexes like a sequence of key rows); otherwise the list of keys
            keys = cast("Sequence[Any]", self._mat[:n]) if self._dense and self._mat is not None else list(self._keys)
        if n == 0:
            return ids, np.zeros(0, dtype=np.float64)
        return ids, np.asarray(self.scorer.score(query_rep, keys), dtype=np.float64)

    def search(self, query_rep: Any, k: int = 1) -> list[Hit]:
        """Top-``k`` cached documents by (exact score desc, doc id asc)."""
        self.lookups += 1
        ids, sc = self.scores(query_rep)
        return rank_hits(ids, sc, k)

    def top1(self, query_rep: Any) -> Hit | None:
        hits = self.search(query_rep, 1)
        return hits[0] if hits else None

    def search_text(self, query: str, k: int = 1) -> list[Hit]:
        """Encode ``query`` with the scorer, then :meth:`search`."""
        return self.search(self.scorer.encode([query])[0], k)

    def stats(self) -> dict[str, int]:
        return {"size": len(self), "lookups": self.lookups, "inserts": self.inserts, "duplicates": self.duplicates}

    def __repr__(self) -> str:
        return f"SpeculativeCache(size={len(self)}, lookups={self.lookups}, inserts={self.inserts})"
