"""The PCA-projected cache scan: a lower bound of the L2 distance, and a cache whose
answer is exactly the full-key cache's (only cheaper to find)."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.knnlm import KnnEntryCache
from ralm.knnlm.datastore import Datastore
from ralm.knnlm.metric import l2_distances, rank_by_distance
from ralm.knnlm.projection import fit_projection, projection_for


def _synthetic_ds(n: int = 6000, d: int = 16, seed: int = 0) -> Datastore:
    """Gaussian keys with a few strong directions: the projection keeps those and ranks
    loosely in the rest, so scans need the boundary expansion."""
    rng = np.random.default_rng(seed)
    scales = np.r_[np.full(3, 4.0), np.full(d - 3, 1.0)]
    keys = (rng.standard_normal((n, d)) * scales).astype(np.float32)
    passage = (np.arange(n) // 50).astype(np.int32)
    return Datastore(keys, rng.integers(0, 100, n).astype(np.int32), passage, {"n_passages": n // 50})


def test_projection_is_orthonormal_and_a_lower_bound():
    ds = _synthetic_ds()
    proj = fit_projection(ds.keys, 3)
    assert proj.reduced.shape == (len(ds), 3)
    np.testing.assert_allclose(proj.basis @ proj.basis.T, np.eye(3), atol=1e-6)
    np.testing.assert_allclose(proj.reduced, ds.keys @ proj.basis.T, rtol=1e-5, atol=1e-5)
    # the strong directions are found: most of the variance sits in the first three axes
    assert np.abs(proj.basis[:, :3]).sum() > 2.5
    rng = np.random.default_rng(1)
    q = rng.standard_normal(ds.dim).astype(np.float32) * 3
    real = l2_distances(ds.keys, q)
    projected = ((proj.reduced - proj.project(q)) ** 2).sum(axis=1)
    assert np.all(projected <= real * (1 + 1e-5) + 1e-4)
    assert np.mean(projected < 0.8 * real) > 0.5  # and a loose one: ranking needs re-scoring


def test_projection_rejects_bad_dims_and_is_shared_per_datastore():
    ds = _synthetic_ds(n=500)
    with pytest.raises(ValueError, match="1..15"):
        fit_projection(ds.keys, 16)
    with pytest.raises(ValueError):
        fit_projection(ds.keys, 0)
    assert projection_for(ds, 4) is projection_for(ds, 4)
    assert projection_for(ds, 4) is not projection_for(ds, 5)


@pytest.mark.parametrize("k", [1, 16, 200, 1024])
def test_projected_cache_returns_the_exact_cached_top_k(k):
    ds = _synthetic_ds()
    full = KnnEntryCache(ds, n_next=10, capacity=5000)
    proj = KnnEntryCache(ds, n_next=10, capacity=5000, project_dims=3)
    assert proj.proj is not None and proj._keys.shape[1] == 3 and full.proj is None
    starts = np.arange(0, 5000, 11)
    full.insert(starts)
    proj.insert(starts)
    ids = proj.entry_ids()
    assert np.array_equal(np.sort(ids), np.sort(full.entry_ids())) and len(ids) > 4000
    rng = np.random.default_rng(k)
    needed_expansion = 0
    for _ in range(12):
        q = (ds.keys[rng.integers(len(ds))] + rng.standard_normal(ds.dim) * 0.5).astype(np.float32)
        want = rank_by_distance(ids, l2_distances(ds.keys[ids], q), k)
        assert proj.search(q, k) == want
        assert full.search(q, k) == want
        # does the first projected candidate set (max(256, 4 (k + margin))) miss a true
        # neighbour? Then only the bound-driven expansion made the answer right.
        n_first = max(256, 4 * (k + max(16, k // 8)))
        if n_first < len(ids):
            pr = ((proj.proj.reduced[ids] - proj.proj.project(q)) ** 2).sum(axis=1)
            first = set(ids[np.argsort(pr, kind="stable")[:n_first]].tolist())
            needed_expansion += any(e not in first for e, _ in want)
    if k == 200:  # (k = 1024: the first scan already takes them all)
        assert needed_expansion > 0  # the test exercises the expansion path


def test_projection_dims_at_or_above_the_key_dim_scan_full_keys():
    ds = _synthetic_ds(n=300)
    for dims in (0, 16, 64):
        c = KnnEntryCache(ds, n_next=2, capacity=1000, project_dims=dims)
        assert c.proj is None and c._keys.shape[1] == 16


def test_default_cache_of_the_project_generator_is_projected(knn_setups):
    from ralm import constants as C
    from ralm.config import KnnLMConfig
    from ralm.knnlm import new_cache

    lm, ds, kbs = knn_setups["pydocs-gpt"]
    cache = new_cache(kbs["flat"], KnnLMConfig(k=16))
    assert ds.dim > C.KNN_CACHE_PROJECT_DIMS and cache.proj is not None
    assert cache.proj.dims == C.KNN_CACHE_PROJECT_DIMS
    assert new_cache(kbs["flat"], KnnLMConfig(k=16, cache_project_dims=0)).proj is None
    assert new_cache(kbs["flat"], KnnLMConfig(k=C.KNN_PROJECTED_MAX_K)).proj is not None
    assert new_cache(kbs["flat"], KnnLMConfig(k=C.KNN_PROJECTED_MAX_K + 1)).proj is None  # full keys above
