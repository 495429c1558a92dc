"""KB search of the KNN-LM datastore: FAISS candidates + exact float64 re-scoring.

The same approach as :mod:`ralm.retrieval.rerank`: FAISS (IndexFlatL2 or HNSW, L2)
proposes ``k + margin`` candidates, they are re-scored with the exact distance
(:func:`ralm.knnlm.metric.l2_distances`) and ranked by (distance asc, entry id asc).
Every entry that is not a candidate has a candidate-stage distance at least the last
candidate's (the *bound*); if the exact k-th distance is not clearly below the bound
(within :func:`~ralm.knnlm.metric.tolerance`, which also covers the float32
``|q|^2 + |x|^2 - 2 q.x`` kernel FAISS uses for batches), the candidate set is doubled.
For the flat index the result is exactly the top-k of the exact distance over the
whole datastore, whatever the batch; for HNSW it is a pure function of the query.

Padding (flat only, ``pad_to``): random vectors of norm ``KNN_PAD_NORM_FACTOR`` times the
largest key norm, so each search scans as many rows as a large datastore; their ids
(>= number of entries) are dropped, and a padding row among the candidates proves that
every real entry is a candidate.

Batched search (verification): for ``len(batch) >= blas_min_batch`` the flat index is
searched through FAISS's BLAS kernel (one matrix product for the whole batch, with
cached norms), so a batch costs much less than that many single searches. The
re-scoring makes the results the same either way.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import numpy as np

from ralm import constants as C
from ralm.knnlm.datastore import Datastore
from ralm.knnlm.metric import Hit, l2_distances, rank_by_distance, tolerance

log = logging.getLogger(__name__)
_BLAS_LOCK = threading.Lock()


def margin_for(k: int, margin: int) -> int:
    return max(int(margin), int(k) // 8)


def exact_knn(k: int, n_first: int, n_max: int, candidates, rescore, scale: float,
              stats: dict | None = None) -> tuple[list[Hit], bool]:
    """Candidate / exact re-score / boundary-expansion loop for one query.

    ``candidates(n) -> (ids, bound, complete)`` with ``bound`` the largest candidate-stage
    distance among the rows returned (None if none). Returns (hits, complete).
    """
    n = max(1, min(n_first, n_max))
    while True:
        ids, bound, complete = candidates(n)
        ids = np.asarray(ids, dtype=np.int64)
        hits = rank_by_distance(ids, rescore(ids) if ids.size else np.zeros(0), k)
        if complete or n >= n_max:
            return hits, complete
        if len(hits) >= k and bound is not None and hits[-1][1] + tolerance(bound, scale) < bound:
            return hits, False
        if stats is not None:
            stats["expansions"] = stats.get("expansions", 0) + 1
        n = min(2 * n, n_max)


class KnnRetriever:
    """The KNN-LM knowledge base: ``search_vectors(queries, k)`` -> hits (entry id, distance)."""

    def __init__(self, datastore: Datastore, index: str = "flat", *, pad_to: int = 0,
                 hnsw_ef_search: int = C.HNSW_EF_SEARCH, rerank_margin: int = C.KNN_RERANK_MARGIN,
                 blas_min_batch: int = 2):
        import faiss

        self.ds = datastore
        self.kind = index
        self.rerank_margin = int(rerank_margin)
        self.blas_min_batch = int(blas_min_batch)
        self.n_entries = len(datastore)
        self.padded_rows = 0
        if index == "flat":
            self.index = datastore.flat_index(pad_to)
            if pad_to and pad_to > self.n_entries:
                self.padded_rows = int(pad_to)
                log.warning("KNN flat index padded to %d rows (%d entries + %d far-away random vectors; "
                            "never returned, results unchanged) to emulate a large datastore",
                            pad_to, self.n_entries, pad_to - self.n_entries)
            if hasattr(self.index, "sync_l2norms"):
                self.index.sync_l2norms()          # cached |x|^2 for the batched BLAS kernel
        elif index == "hnsw":
            if datastore.hnsw is None:
                raise ValueError("the datastore has no HNSW index: build it with build_hnsw() or hnsw=True")
            if pad_to:
                log.warning("pad_to=%d ignored: padding only applies to the flat KNN index", pad_to)
            self.index = datastore.hnsw
            faiss.downcast_index(self.index).hnsw.efSearch = int(hnsw_ef_search)
            self.ef_search = int(hnsw_ef_search)
        else:
            raise ValueError(f"KNN index must be 'flat' or 'hnsw', not {index!r}")
        self.n_rows = int(self.index.ntotal)
        self.name = f"knn-{index}" + (f"(padded to {self.padded_rows:,})" if self.padded_rows else "")
        self.stats = {"searches": 0, "batches": 0, "expansions": 0, "exhaustive": 0}
        self._key_scale = datastore.max_norm ** 2

    def __repr__(self) -> str:
        return f"KnnRetriever({self.kind!r}, entries={self.n_entries}, rows={self.n_rows})"

    # ------------------------------------------------------------------ FAISS
    def _faiss(self, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        Q = np.ascontiguousarray(Q, dtype=np.float32)
        if self.kind == "flat" and len(Q) >= self.blas_min_batch:
            with _BLAS_LOCK:                 # the threshold is a FAISS global
                old = faiss.cvar.distance_compute_blas_threshold
                faiss.cvar.distance_compute_blas_threshold = 1
                try:
                    return self.index.search(Q, int(n))
                finally:
                    faiss.cvar.distance_compute_blas_threshold = old
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = max(self.ef_search, int(n))   # HNSW returns at most efSearch rows
            return self.index.search(Q, int(n), params=params)
        return self.index.search(Q, int(n))

    def _cands(self, D: np.ndarray, I: np.ndarray, n: int):
        valid = I >= 0
        bound = float(D[valid][-1]) if valid.any() else None
        real = valid & (I < self.n_entries)
        complete = n >= self.n_rows or int(valid.sum()) < n or bool((valid & ~real).any())
        return I[real], bound, complete

    def _resolve(self, q: np.ndarray, k: int, first) -> list[Hit]:
        n_first = min(k + margin_for(k, self.rerank_margin), self.n_rows)
        scale = float(np.dot(q.astype(np.float64), q.astype(np.float64))) + self._key_scale

        def candidates(n: int):
            nonlocal first
            if first is not None and n == n_first:
                D, I = first
                first = None
            else:
                D, I = self._faiss(q[None, :], n)
                D, I = D[0], I[0]
            return self._cands(D, I, n)

        def rescore(ids):
            return l2_distances(self.ds.keys[ids], q)

        hits, _ = exact_knn(k, n_first, self.n_rows, candidates, rescore, scale, self.stats)
        if len(hits) < min(k, self.n_entries):
            # HNSW returned fewer candidates than asked: rank every entry exactly instead
            self.stats["exhaustive"] += 1
            hits = rank_by_distance(np.arange(self.n_entries), l2_distances(self.ds.keys, q), k)
        return hits

    # ------------------------------------------------------------------ search
    def search_vectors(self, queries: Sequence[np.ndarray] | np.ndarray, k: int) -> list[list[Hit]]:
        """Top-``k`` entries for each query vector (one batched FAISS call + exact re-scoring);
        each query's answer is independent of the batch it is in."""
        if len(queries) == 0:
            return []
        if not 1 <= k <= C.KNN_MAX_K:
            raise ValueError(f"k must be in 1..{C.KNN_MAX_K}, got {k}")
        Q = np.stack([np.asarray(q, dtype=np.float32).reshape(-1) for q in queries])
        if Q.shape[1] != self.ds.dim:
            raise ValueError(f"query dimension {Q.shape[1]} != datastore dimension {self.ds.dim}")
        n_first = min(k + margin_for(k, self.rerank_margin), self.n_rows)
        D, I = self._faiss(Q, n_first)
        self.stats["searches"] += len(Q)
        self.stats["batches"] += 1
        return [self._resolve(Q[i], k, (D[i], I[i])) for i in range(len(Q))]

    def search(self, query: np.ndarray, k: int) -> list[Hit]:
        return self.search_vectors([query], k)[0]

    def timed_search(self, queries, k: int) -> tuple[list[list[Hit]], float]:
        t0 = time.perf_counter()
        res = self.search_vectors(queries, k)
        return res, time.perf_counter() - t0


def load_knn_retriever(datastore: Datastore, cfg) -> KnnRetriever:
    """A :class:`KnnRetriever` from a :class:`~ralm.config.KnnLMConfig`."""
    if cfg.index == "hnsw" and datastore.hnsw is None:
        datastore.build_hnsw(cfg.hnsw_m, cfg.hnsw_ef_construction)
    return KnnRetriever(datastore, cfg.index, pad_to=cfg.pad_to, hnsw_ef_search=cfg.hnsw_ef_search,
                        rerank_margin=cfg.rerank_margin)
