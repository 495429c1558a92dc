"""Per-query candidate bookkeeping shared by the bounded scans (bf16, int8).

A bounded scan computes an approximate score ``s^`` per (row, query) and a bound ``eps``
with ``|s^ - s| <= eps`` for the exact score ``s``. Rows are fed in as they are scanned;
:class:`CandidateTracker` keeps, per query,

- ``L``: the k-th largest lower bound ``s^ - eps`` seen over real rows, so the exact k-th
  best score is at least ``L``;
- every row whose upper bound ``s^ + eps`` reached the ``L`` of its time.

``L`` only grows, so a row dropped against an earlier ``L`` stays out; the final candidate
set ``{r : s^_r + eps_r >= L}`` therefore holds the exact top-k, which the caller ranks by
exact re-scoring.

Worked example (k = 1): rows fed with (s^, eps) = (0.70, 0.01), (0.695, 0.01), (0.60, 0.01):
lower bounds 0.69, 0.685, 0.59 give L = 0.69; upper bounds 0.71, 0.705, 0.61: rows 0 and 1
are candidates, row 2 is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def query_matrix(queries: np.ndarray | Sequence[np.ndarray], dim: int) -> np.ndarray:
    """Queries as a contiguous (b, dim) float32 array."""
    return np.ascontiguousarray(np.asarray(queries, dtype=np.float32).reshape(-1, dim))


def trivial_candidates(b: int, k: int, n_real: int) -> list[np.ndarray] | None:
    """The candidates when no scan is needed (no queries, ``k <= 0``, or ``k`` covering
    every real row), else None."""
    if b == 0:
        return []
    if k <= 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(b)]
    if k >= n_real:
        return [np.arange(n_real, dtype=np.int64) for _ in range(b)]
    return None


class CandidateTracker:
    """Candidate state of ``b`` queries for a top-``k`` search."""

    def __init__(self, b: int, k: int):
        self.k = int(k)
        self.L = np.full(b, -np.inf)  # (b,) running k-th lower bound per query
        self._lowers: list[np.ndarray] = [np.zeros(0) for _ in range(b)]  # its k best lower bounds
        self._ids: list[list[np.ndarray]] = [[] for _ in range(b)]
        self._ups: list[list[np.ndarray]] = [[] for _ in range(b)]

    def raise_floor(self, lower: np.ndarray) -> None:
        """``lower`` (b,): for each query, a value known to be <= its exact k-th best score
        (e.g. the k-th largest lower bound of a first block)."""
        self.L = np.maximum(self.L, lower)

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, eps: np.ndarray) -> None:
        """Scanned entries: real row ids (m,), query indexes (m,), ``s^`` (m,) and ``eps``
        (m,), all float64 for the last two."""
        for j in np.unique(cols):
            sel = cols == j
            up = vals[sel] + eps[sel]
            keep = up >= self.L[j]
            if not keep.any():
                continue
            self._ids[j].append(rows[sel][keep])
            self._ups[j].append(up[keep])
            lo = np.concatenate([self._lowers[j], (vals[sel] - eps[sel])[keep]])
            if lo.size > self.k:
                lo = np.partition(lo, lo.size - self.k)[-self.k :]
            self._lowers[j] = lo
            if lo.size == self.k:
                self.L[j] = max(self.L[j], float(lo.min()))

    def add_block(
        self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, eps: np.ndarray, real: int, offset: int
    ) -> None:
        """The entries one block of a scan kept: ``rows`` relative to the block, which holds
        ``real`` real rows from row ``offset`` on. While the queries have no floor yet (the
        first block, which keeps every entry), the block's k-th largest lower bound per query
        becomes their floor."""
        if not np.isfinite(self.L).all() and real >= self.k:
            lower = np.full((real, len(self.L)), -np.inf)
            lower[rows, cols] = vals - eps
            self.raise_floor(np.partition(lower, real - self.k, axis=0)[real - self.k])
        self.add(rows + offset, cols, vals, eps)

    def result(self) -> list[np.ndarray]:
        """Per query, the sorted candidate row ids (they contain its exact top-k)."""
        out = []
        for j in range(len(self._ids)):
            if not self._ids[j]:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            ids = np.concatenate(self._ids[j])
            up = np.concatenate(self._ups[j])
            out.append(np.sort(ids[up >= self.L[j]]))
        return out
