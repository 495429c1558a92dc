"""Candidate generation + exact re-scoring + boundary expansion (shared by all KBs).

A KB retriever asks its candidate generator (FAISS, Lucene) for ``k + margin``
candidates, re-scores them with its exact scoring function and ranks them, ties by id
ascending: by score descending for inner-product / BM25 scores
(:func:`~ralm.retrieval.base.rank_hits`), by distance ascending for KNN-LM's squared L2
(:func:`ralm.knnlm.retriever.exact_knn`). Every document that is *not* a candidate has a
candidate-stage score no better than the last candidate's (the *bound*). The candidate
stage is only approximately equal to the exact score (float32 kernels, batch-dependent
summation order), so if the exact k-th score is not clearly better than the bound -
within ``tol(bound)``, by default ``TIE_EPS * max(1, |bound|)`` - a non-candidate might
belong in the top-k: the candidate set is doubled and the query retried.
For exact candidate generators (flat search, Lucene) the result is therefore exactly
the top-k of the exact scorer over the whole KB, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ralm import constants as C
from ralm.retrieval.base import Hit, rank_hits


@dataclass
class Candidates:
    """One candidate-stage answer for one query.

    ids: candidate doc ids (real documents only; padding removed).
    bound: the lowest candidate-stage score among the rows returned (padding included);
        ``None`` when nothing was returned.
    complete: every document not in ``ids`` is known not to outrank them (the search
        returned fewer rows than asked for, or scanned every row).
    """

    ids: np.ndarray
    bound: float | None
    complete: bool


def tolerance(bound: float) -> float:
    return C.TIE_EPS * max(1.0, abs(float(bound)))


def _rank(ids: np.ndarray, scores: np.ndarray, k: int, descending: bool) -> list[Hit]:
    """Top-``k`` by (score desc, id asc), or by (score asc, id asc). Negation is exact in
    floating point, so the ascending order is the descending one of ``-scores``."""
    if descending:
        return rank_hits(ids, scores, k)
    return [(i, -s) for i, s in rank_hits(ids, -scores, k)]


def exact_top_k(
    k: int,
    n_first: int,
    n_max: int,
    candidates: Callable[[int], Candidates],
    rescore: Callable[[np.ndarray], np.ndarray],
    stats: dict | None = None,
    *,
    descending: bool = True,
    tol: Callable[[float], float] = tolerance,
    extra_tol: float = 0.0,
) -> tuple[list[Hit], Candidates]:
    """Run the candidate/re-score/expand loop for one query.

    ``candidates(n)`` returns :class:`Candidates` for ``n`` requested rows; ``n_first``
    is the first request, doubled until the boundary is clear or ``n_max`` (all rows)
    is reached. Returns the hits and the last :class:`Candidates` (callers may need
    ``complete`` to fill in unmatched documents).

    ``descending``: higher scores rank first (inner product, BM25); ``False``: lower
    scores (distances) do, and then ``bound`` is the *largest* candidate-stage distance.
    The boundary is clear when the exact k-th score beats the bound by more than
    ``tol(bound) + extra_tol`` (``extra_tol``: a candidate stage that is looser still,
    e.g. projected distances).
    """
    n = max(1, min(n_first, n_max))
    while True:
        cand = candidates(n)
        ids = np.asarray(cand.ids, dtype=np.int64)
        scores = rescore(ids) if ids.size else np.zeros(0, dtype=np.float64)
        hits = _rank(ids, np.asarray(scores, dtype=np.float64), k, descending)
        if cand.complete or n >= n_max:
            return hits, cand
        if len(hits) >= k and cand.bound is not None:
            kth, bound = hits[-1][1], cand.bound
            if descending:
                clear = kth - tol(bound) - extra_tol > bound
            else:
                clear = kth + tol(bound) + extra_tol < bound
            if clear:
                return hits, cand
        if stats is not None:
            stats["expansions"] = stats.get("expansions", 0) + 1
        n = min(2 * n, n_max)
