"""One FAISS flat search, on the kernel that suits the batch.

FAISS's flat inner-product search scans the index once per query below
``faiss.cvar.distance_compute_blas_threshold`` (20 queries) and runs one GEMM over the index
for the whole batch at or above it. The per-query scan is the faster one for a single
query, the GEMM for any batch: measured on 1M x 384, one thread, 154 ms for 1 query but
2,481 ms for 8 through the scan, 380-480 ms for 1-16 through the GEMM. So a batch of two or
more goes through the GEMM (the threshold set to 1 for that call, under a lock: it is a
process-wide FAISS variable) and a single query through the scan. Which kernel ran never
changes a result of the retrievers: their FAISS candidates are re-scored exactly.

:class:`FaissScan` is FAISS's candidate stage of a dense retriever, with that exact
re-scoring, as a candidate scan (:mod:`ralm.retrieval.scans`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from ralm.retrieval.rerank import Candidates, exact_top_k

_BLAS_LOCK = threading.Lock()


def faiss_search(index, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``index.search(Q, n)`` with batches (``Q`` of 2 or more rows) on FAISS's BLAS path:
    ``(D [b, n] scores, I [b, n] row ids)``."""
    Q = np.ascontiguousarray(Q, dtype=np.float32)
    if Q.shape[0] < 2:
        return index.search(Q, int(n))
    import faiss

    with _BLAS_LOCK:
        old = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = 1
        try:
            return index.search(Q, int(n))
        finally:
            faiss.cvar.distance_compute_blas_threshold = old


class FaissScan:
    """The FAISS candidate stage of a dense index as a candidate scan
    (:class:`~ralm.retrieval.scans.CandidateScan`): per query, the exact top-k ids.

    FAISS proposes ``k + rerank_margin`` candidates per query (one batched search), they are
    re-scored exactly (``score_ids(query, ids)``) and, while the exact k-th score is not clearly
    above FAISS's last candidate score, the candidate set is doubled
    (:func:`~ralm.retrieval.rerank.exact_top_k`). An index that runs out of candidates (HNSW, for
    a very large k) is ranked exhaustively instead. ``flat``: a flat index, whose batches take
    FAISS's BLAS path (:func:`faiss_search`). Ids at or above ``n_real`` (padding) never return.
    """

    label = "faiss"

    def __init__(
        self,
        index,
        n_real: int,
        score_ids: Callable[[np.ndarray, np.ndarray], np.ndarray],
        *,
        rerank_margin: int,
        flat: bool,
        faiss_threads: int = 0,
        stats: dict | None = None,
    ):
        self.index = index
        self.n_real = int(n_real)
        self.score_ids = score_ids
        self.rerank_margin = int(rerank_margin)
        self.flat = bool(flat)
        self.faiss_threads = int(faiss_threads)
        self.stats = stats if stats is not None else {}

    @property
    def n_rows(self) -> int:
        return int(self.index.ntotal)

    def _search(self, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.faiss_threads:
            # OpenMP's thread count is per calling thread: set it in *this* thread, which
            # may be an asynchronous-verification worker (else it would use one thread per
            # core next to the generator, and oversubscribed spin-waiting made searches ~6x
            # slower in our measurements).
            import faiss

            faiss.omp_set_num_threads(self.faiss_threads)
        if self.flat:
            return faiss_search(self.index, Q, n)  # batches on FAISS's BLAS path
        return self.index.search(np.ascontiguousarray(Q, dtype=np.float32), int(n))

    def _candidates(self, D: np.ndarray, I: np.ndarray, n: int) -> Candidates:
        valid = I >= 0
        bound = float(D[valid][-1]) if valid.any() else None
        real = valid & (I < self.n_real)
        complete = n >= self.n_rows or int(valid.sum()) < n
        return Candidates(ids=I[real].astype(np.int64), bound=bound, complete=complete)

    def _resolve(self, q: np.ndarray, k: int, first: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        n_first = min(k + self.rerank_margin, self.n_rows)

        def candidates(n: int) -> Candidates:
            nonlocal first
            if first is not None and n == n_first:
                D, I = first
                first = None
            else:
                D, I = self._search(q[None, :], n)
                D, I = D[0], I[0]
            return self._candidates(D, I, n)

        hits, _ = exact_top_k(k, n_first, self.n_rows, candidates, lambda ids: self.score_ids(q, ids), self.stats)
        if len(hits) < min(k, self.n_real):
            # HNSW ran out of candidates (it returns fewer than asked for very large k):
            # every real row is a candidate instead
            self.stats["exhaustive"] = self.stats.get("exhaustive", 0) + 1
            return np.arange(self.n_real, dtype=np.int64)
        return np.sort(np.asarray([d for d, _ in hits], dtype=np.int64))

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        Q = np.stack([np.asarray(q, dtype=np.float32) for q in queries])
        n_first = min(int(k) + self.rerank_margin, self.n_rows)
        D, I = self._search(Q, n_first)
        return [self._resolve(Q[i], int(k), (D[i], I[i])) for i in range(len(Q))]
