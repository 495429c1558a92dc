"""The one distance function of KNN-LM: exact, layout-independent float64 squared L2.

The KB re-scorer and the speculative cache both rank with :func:`l2_distances` and the
order (distance ascending, entry id ascending), so when they hold the same entries they
return the same list, bit for bit.

Every row is computed by the same sequence of IEEE operations whatever the number of
rows or their memory layout: float32 inputs are widened to float64, differences and
squares are elementwise, and the ``d`` squares are summed by a fixed pairwise tree
(halving, zero-padded to a power of two) with elementwise numpy adds - no BLAS and no
reduction whose order depends on the array shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cache.ranking import rank_hits
from ralm import constants as C

Hit = tuple[int, float]  # (entry id, exact squared L2 distance)


def l2_distances(keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """float64 squared L2 distances of ``query`` (d,) to each row of ``keys`` (n, d).

    Row ``r``'s value is ``tree_sum((float64(k_r) - float64(q)) ** 2)`` with the fixed
    pairwise tree, whatever ``n`` is. (Computed on the transposed (d, n) array so the
    tree's adds run over contiguous blocks; each element goes through the same
    operations as in the row layout.)
    """
    K = np.asarray(keys)
    if K.ndim == 1:
        K = K[None, :]
    q = np.asarray(query, dtype=np.float64).reshape(-1)
    n = K.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    d = K.shape[1]
    if d != q.shape[0]:
        raise ValueError(f"key dimension {d} != query dimension {q.shape[0]}")
    width = 1 << max(0, (d - 1).bit_length())
    buf = np.zeros((width, n), dtype=np.float64)
    buf[:d] = K.T  # float32 -> float64 is exact
    np.subtract(buf[:d], q[:, None], out=buf[:d])
    np.multiply(buf[:d], buf[:d], out=buf[:d])
    while width > 1:
        width //= 2
        np.add(buf[:width], buf[width : 2 * width], out=buf[:width])
    return buf[0].copy()


def rank_by_distance(ids: np.ndarray | Sequence[int], dists: np.ndarray | Sequence[float], k: int) -> list[Hit]:
    """Top-``k`` of ``(ids, dists)`` ordered by (distance asc, entry id asc); duplicates kept once.

    Example: ids [7, 3, 5], dists [0.5, 0.9, 0.5], k=2 -> [(5, 0.5), (7, 0.5)].
    The one ranking kernel (:func:`cache.ranking.rank_hits`, score desc) on the negated
    distances: negation is exact in floating point, so the order and the values are too.
    """
    d = np.asarray(dists, dtype=np.float64)
    return [(i, -s) for i, s in rank_hits(ids, -d, k)]


def tolerance(bound: float, scale: float) -> float:
    """How far a float32 candidate-stage distance may be from the exact one.

    FAISS computes L2 either directly (error relative to the distance) or as
    ``|q|^2 + |x|^2 - 2 q.x`` (error relative to the norms, ``scale``), so both count.
    """
    return C.TIE_EPS * max(1.0, abs(float(bound))) + 1e-5 * float(scale)
