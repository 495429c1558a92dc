"""One FAISS flat search, on the kernel that suits the batch.

FAISS's flat inner-product search scans the index once per query below
``faiss.cvar.distance_compute_blas_threshold`` (20 queries) and runs one GEMM over the index
for the whole batch at or above it. The per-query scan is the faster one for a single
query, the GEMM for any batch: measured on 1M x 384, one thread, 154 ms for 1 query but
2,481 ms for 8 through the scan, 380-480 ms for 1-16 through the GEMM. So a batch of two or
more goes through the GEMM (the threshold set to 1 for that call, under a lock: it is a
process-wide FAISS variable) and a single query through the scan. Which kernel ran never
changes a result of the retrievers: their FAISS candidates are re-scored exactly.
"""

from __future__ import annotations

import threading

import numpy as np

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
