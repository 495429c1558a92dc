"""The speculative cache of KNN-LM: datastore entries a request is likely to need next.

After each KB retrieval the retrieved entries **and the next n entries after each**
(same passage; spatial locality: if the context matched entry i, the next context
likely matches entry i + 1) are inserted. A speculative step asks the cache for its
``k`` nearest entries, ranked with the KB's exact distance and tie-break
(:func:`ralm.knnlm.metric.l2_distances`, then entry id), so when the KB's neighbours
are all cached, the cache returns the KB's list exactly.

Storage: a ring buffer of at most ``capacity`` entries (first in, first out; a
re-inserted entry keeps its place), keys copied once at insertion. Search: FAISS brute
force L2 over the buffer for candidates, then the same exact re-scoring and boundary
expansion as the KB (:func:`ralm.knnlm.retriever.exact_knn`). With ``project_dims`` = r
(``KnnLMConfig.cache_project_dims``, default 64) the ring holds the keys' PCA projection
(:mod:`ralm.knnlm.projection`): the scan reads d / r times less, and since a projected
distance is a lower bound of the real one, the re-scoring and expansion still return
exactly the top-k of the cached entries. (A bf16 ring with bf16_scan's bound was tried:
no faster here - 5.5 vs 6.7 ms at 90K entries, slower below 20K.)

Capacity (:func:`default_capacity`): room for the entries of ``retrievals`` (default
``KNN_CACHE_RETRIEVALS`` = 32, ``KnnLMConfig.cache_retrievals``) KB answers (each
``p (n + 1)`` entries, p = entries fetched per query), at least ``KNN_CACHE_MIN_ENTRIES``
and at most the datastore's size (the ring holds distinct entries). A verification inserts
the answers of a whole window at once, so a capacity of only 2 answers kept little more
than the window's last two queries. The ring's pages are touched only as it fills, so a
request pays memory for what it inserted: at k = 16 with the defaults (p = 1,024, n = 20)
an answer adds up to 21.5K entries, 5.5 MB of 64-dimensional projected keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from ralm import constants as C
from ralm.knnlm.datastore import Datastore
from ralm.knnlm.metric import Hit, l2_distances
from ralm.knnlm.projection import projection_for, projection_tolerance
from ralm.knnlm.retriever import exact_knn, margin_for


def default_capacity(k: int, n_next: int, retrievals: int = C.KNN_CACHE_RETRIEVALS, entries: int = 0) -> int:
    """max(KNN_CACHE_MIN_ENTRIES, retrievals * k * (n + 1)), at most ``entries`` (the
    datastore's size; 0: no bound): ``k`` = entries fetched per query."""
    cap = max(C.KNN_CACHE_MIN_ENTRIES, int(retrievals) * int(k) * (int(n_next) + 1))
    return min(cap, int(entries)) if entries > 0 else cap


class KnnEntryCache:
    def __init__(
        self,
        datastore: Datastore,
        n_next: int = C.KNN_SPATIAL_NEXT,
        capacity: int = C.KNN_CACHE_MIN_ENTRIES,
        rerank_margin: int = C.KNN_RERANK_MARGIN,
        project_dims: int = 0,
    ):
        self.ds = datastore
        self.n_next = int(n_next)
        self.capacity = int(capacity)
        self.rerank_margin = int(rerank_margin)
        # scanned key rows: the PCA projection (r dims) or the keys themselves (d dims)
        self.proj = projection_for(datastore, project_dims)
        self._rows = self.proj.reduced if self.proj is not None else datastore.keys
        self._keys = np.empty((self.capacity, self._rows.shape[1]), dtype=np.float32)
        self._ids = np.full(self.capacity, -1, dtype=np.int64)
        self._slot_of = np.full(len(datastore), -1, dtype=np.int64)  # entry id -> ring slot
        self._pos = 0  # next ring slot
        self._filled = 0
        self.inserted = 0  # entries ever added
        self.lookups = 0  # searches run, and their total wall time
        self.lookup_s = 0.0
        self._key_scale = datastore.max_norm**2

    def __len__(self) -> int:
        return self._filled

    def __contains__(self, entry_id: int) -> bool:
        e = int(entry_id)
        return 0 <= e < len(self._slot_of) and self._slot_of[e] >= 0

    def entry_ids(self) -> np.ndarray:
        return self._ids[: self._filled].copy()

    def clear(self) -> None:
        self._slot_of[self._ids[self._ids >= 0]] = -1
        self._ids[:] = -1
        self._pos = self._filled = 0

    # ------------------------------------------------------------------ insert
    def expand(self, entry_ids: Iterable[int]) -> np.ndarray:
        """``entry_ids`` and the ``n_next`` entries after each within its passage, in order,
        duplicates removed (first occurrence kept)."""
        base = (
            np.fromiter((int(e) for e in entry_ids), dtype=np.int64)
            if not isinstance(entry_ids, np.ndarray)
            else entry_ids.astype(np.int64).reshape(-1)
        )
        if base.size == 0:
            return base
        cand = base[:, None] + np.arange(self.n_next + 1, dtype=np.int64)[None, :]
        ok = cand < len(self.ds)
        same = np.zeros_like(ok)
        same[ok] = (
            self.ds.passage[cand[ok]] == np.repeat(self.ds.passage[base], self.n_next + 1).reshape(cand.shape)[ok]
        )
        flat = cand[same]
        _, first = np.unique(flat, return_index=True)
        return flat[np.sort(first)]

    def insert_hits(self, hits_per_query: Iterable[Iterable[Hit]]) -> int:
        return self.insert(np.fromiter((e for hits in hits_per_query for e, _ in hits), dtype=np.int64))

    def insert(self, entry_ids: Iterable[int]) -> int:
        """Insert entries and their spatial successors; returns how many were new."""
        ids = self.expand(entry_ids)
        new_arr = ids[self._slot_of[ids] < 0] if ids.size else ids
        if new_arr.size == 0:
            return 0
        if len(new_arr) > self.capacity:
            new_arr = new_arr[-self.capacity :]
        slots = (self._pos + np.arange(len(new_arr))) % self.capacity
        old = self._ids[slots]
        self._slot_of[old[old >= 0]] = -1
        self._ids[slots] = new_arr
        self._keys[slots] = self._rows[new_arr]
        self._slot_of[new_arr] = slots
        self._pos = int((self._pos + len(new_arr)) % self.capacity)
        self._filled = min(self.capacity, self._filled + len(new_arr))
        self.inserted += len(new_arr)
        return len(new_arr)

    # ------------------------------------------------------------------ search
    def search(self, query: np.ndarray, k: int) -> list[Hit]:
        """The ``k`` nearest cached entries by (exact distance asc, entry id asc)."""
        t0 = time.perf_counter()
        try:
            return self._search(query, k)
        finally:
            self.lookups += 1
            self.lookup_s += time.perf_counter() - t0

    def _search(self, query: np.ndarray, k: int) -> list[Hit]:
        import faiss

        n_rows = self._filled
        if n_rows == 0 or k <= 0:
            return []
        q = np.asarray(query, dtype=np.float32).reshape(1, -1)
        keys = self._keys[:n_rows]
        ids_all = self._ids[:n_rows]
        scale = float(np.dot(q[0].astype(np.float64), q[0].astype(np.float64))) + self._key_scale
        margin = margin_for(k, self.rerank_margin)
        if self.proj is None:
            q_scan, extra_tol, n_first = q, 0.0, k + margin
        else:
            # projected distances bound the real ones from below but rank more loosely:
            # start with more candidates so that one scan usually suffices
            q_scan = self.proj.project(q[0])
            extra_tol = projection_tolerance(self.ds.dim, self.proj.dims, scale)
            n_first = max(C.KNN_PROJECTED_MIN_CANDIDATES, C.KNN_PROJECTED_CANDIDATE_FACTOR * (k + margin))

        def candidates(n: int):
            if n >= n_rows:
                return ids_all, None, True
            D, I = faiss.knn(q_scan, keys, int(n), metric=faiss.METRIC_L2)
            D, I = D[0], I[0]
            valid = I >= 0
            return ids_all[I[valid]], (float(D[valid][-1]) if valid.any() else None), int(valid.sum()) < n

        def rescore(ids):
            return l2_distances(self.ds.keys[ids], q[0])

        hits, _ = exact_knn(k, min(n_first, n_rows), n_rows, candidates, rescore, scale, extra_tol=extra_tol)
        return hits
