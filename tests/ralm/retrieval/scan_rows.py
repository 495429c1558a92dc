"""Rows for the bounded-scan tests (bf16, int8): unit vectors, planted ties, exact top-k."""

from __future__ import annotations

import numpy as np

from ralm.retrieval.base import rank_hits
from ralm.retrieval.dense import dense_scores


def unit_rows(rng, n, d):
    """(n, d) float32 rows of norm 1."""
    X = rng.standard_normal((n, d)).astype(np.float32)
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def with_ties(X):
    """Exact duplicates and 1-ulp neighbours straddling any top-k boundary near row 5."""
    X = X.copy()
    X[100:140] = X[5]
    X[140] = X[5] * np.float32(1 + 2**-23)
    X[141] = X[5] * np.float32(1 - 2**-23)
    return X


def exact_top(X, q, k):
    """The exact top-``k`` hits of ``q`` over the rows ``X`` (inner product, float64)."""
    return rank_hits(np.arange(X.shape[0]), dense_scores(X, q), k)


def assert_candidates_hold_the_exact_top_k(scan, X, Q, k):
    """Every query's candidates, re-scored exactly, give its exact top-``k``, and padding
    rows (ids past ``X``) are never candidates."""
    cands = scan.candidates(Q, k)
    assert len(cands) == len(Q)
    for i in range(len(Q)):
        got = rank_hits(cands[i], dense_scores(X[cands[i]], Q[i]), k)
        assert got == exact_top(X, Q[i], k)
        assert (cands[i] < X.shape[0]).all()  # padding is never a candidate


def assert_batch_independent(scan, X, Q, k):
    """Each query ranks the same alone as inside the batch ``Q``."""
    together = scan.candidates(Q, k)
    for i in range(len(Q)):
        alone = scan.candidates(Q[i : i + 1], k)[0]
        assert rank_hits(alone, dense_scores(X[alone], Q[i]), k) == rank_hits(
            together[i], dense_scores(X[together[i]], Q[i]), k
        )
