"""Candidate generation + exact re-scoring + boundary expansion (shared by all KBs).

A KB retriever asks its candidate generator (FAISS, Lucene) for ``k + margin``
candidates, re-scores them with its :class:`~ralm.retrieval.base.ExactScorer` and
ranks them with :func:`~ralm.retrieval.base.rank_hits`. Every document that is *not* a
candidate has a candidate-stage score no higher than the last candidate's (the
*bound*). The candidate stage is only approximately equal to the exact score (float32
kernels, batch-dependent summation order), so if the exact k-th score is not clearly
above the bound - within ``tol(bound) = TIE_EPS * max(1, |bound|)`` - a non-candidate
might belong in the top-k: the candidate set is doubled and the query retried.
For exact candidate generators (flat search, Lucene) the result is therefore exactly
the top-k of the exact scorer over the whole KB, whatever the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def exact_top_k(k: int, n_first: int, n_max: int,
                candidates: Callable[[int], Candidates],
                rescore: Callable[[np.ndarray], np.ndarray],
                stats: dict | None = None) -> tuple[list[Hit], Candidates]:
    """Run the candidate/re-score/expand loop for one query.

    ``candidates(n)`` returns :class:`Candidates` for ``n`` requested rows; ``n_first``
    is the first request, doubled until the boundary is clear or ``n_max`` (all rows)
    is reached. Returns the hits and the last :class:`Candidates` (callers may need
    ``complete`` to fill in unmatched documents).
    """
    n = max(1, min(n_first, n_max))
    while True:
        cand = candidates(n)
        ids = np.asarray(cand.ids, dtype=np.int64)
        scores = rescore(ids) if ids.size else np.zeros(0, dtype=np.float64)
        hits = rank_hits(ids, scores, k)
        if cand.complete or n >= n_max:
            return hits, cand
        if len(hits) >= k and cand.bound is not None and hits[-1][1] - tolerance(cand.bound) > cand.bound:
            return hits, cand
        if stats is not None:
            stats["expansions"] = stats.get("expansions", 0) + 1
        n = min(2 * n, n_max)
