"""The speculative cache: spatial-locality insertion, FIFO capacity, and ranking that
is identical to the KB's when the KB's neighbours are cached."""

from __future__ import annotations

import numpy as np

from ralm.knnlm import KnnEntryCache
from ralm.knnlm.metric import l2_distances, rank_by_distance


def test_insert_adds_the_next_n_entries_within_the_passage(tiny_ds):
    ds = tiny_ds
    cache = KnnEntryCache(ds, n_next=10, capacity=100_000)
    starts = np.flatnonzero(np.r_[True, ds.passage[1:] != ds.passage[:-1]])
    first = int(starts[1])  # first entry of the second passage
    assert cache.insert([first]) == 11
    assert sorted(cache.entry_ids().tolist()) == list(range(first, first + 11))
    # the last entry of a passage has no successor in the same passage
    last = int(starts[2]) - 1
    assert cache.insert([last]) == 1 and last in cache and last + 1 not in cache
    # three entries before the end: itself + 2 successors
    cache.clear()
    assert len(cache) == 0
    assert cache.insert([last - 2]) == 3
    # duplicates and overlaps are inserted once
    assert cache.insert([last - 2, last - 1]) == 0


def test_fifo_capacity(tiny_ds):
    cache = KnnEntryCache(tiny_ds, n_next=0, capacity=5)
    cache.insert(range(0, 5))
    cache.insert([10, 11])
    assert sorted(cache.entry_ids().tolist()) == [2, 3, 4, 10, 11]
    assert 0 not in cache and 1 not in cache and len(cache) == 5
    cache.insert([3])  # already there: nothing evicted
    assert sorted(cache.entry_ids().tolist()) == [2, 3, 4, 10, 11]


def test_cache_ranks_like_the_kb(knn_setups):
    lm, ds, kbs = knn_setups["tiny-gpt2"]
    rng = np.random.default_rng(5)
    queries = (
        ds.keys[rng.choice(len(ds), 12, replace=False)] + rng.standard_normal((12, ds.dim)).astype(np.float32) * 0.05
    )
    for kind, kb in kbs.items():
        for k in (1, 16, 256, 1024):
            cache = KnnEntryCache(ds, n_next=10, capacity=50_000)
            truth = kb.search_vectors(queries, k)
            cache.insert_hits(truth)
            for q, t in zip(queries, truth):
                if kind == "flat":
                    # exact KB: nothing in the cache can beat the KB's neighbours
                    assert cache.search(q, k) == t, (kind, k)
                else:
                    # approximate KB: the cache may hold closer entries the graph search
                    # missed, so compare on a cache holding exactly the KB's answer
                    own = KnnEntryCache(ds, n_next=0, capacity=4096)
                    own.insert_hits([t])
                    assert own.search(q, k) == t, (kind, k)
            # and in general the cache's answer is the exact ranking of what it holds
            ids = cache.entry_ids()
            q = queries[0] * 0.5
            assert cache.search(q, k) == rank_by_distance(ids, l2_distances(ds.keys[ids], q), k)


def test_default_capacity_holds_several_answers(knn_setups):
    from ralm.config import KnnLMConfig, SpecConfig
    from ralm.knnlm import new_cache
    from ralm.knnlm.cache import default_capacity

    assert default_capacity(16, 10, retrievals=8) == 4096  # the minimum
    assert default_capacity(1024, 20) == 32 * 1024 * 21  # 32 KB answers with successors
    assert default_capacity(1024, 10, retrievals=2) == 2 * 1024 * 11
    assert default_capacity(1024, 10, retrievals=2, entries=5000) == 5000  # at most the datastore
    lm, ds, kbs = knn_setups["tiny-gpt2"]
    n = len(ds)
    no_p = SpecConfig()
    assert new_cache(kbs["flat"], KnnLMConfig(k=16, cache_retrievals=2, spatial_next=3), no_p).capacity == min(4096, n)
    small = KnnLMConfig(k=1, spatial_next=0, cache_retrievals=2, prefetch_size=1024)
    assert new_cache(kbs["flat"], small, SpecConfig(prefetch=True)).capacity == min(max(4096, 2 * 1024), n)
    assert new_cache(kbs["flat"], KnnLMConfig(k=256)).capacity == n  # PS by default: 32 x 1024 x 21 > n
    assert new_cache(kbs["flat"], KnnLMConfig(k=256, cache_max_entries=777)).capacity == 777
