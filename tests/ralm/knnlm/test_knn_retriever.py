"""KB search: exact (flat == brute force over every entry), ordered by (distance, id), and
independent of batch composition (alone vs in a batch of 64), for flat (padded) and HNSW."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.knnlm import Datastore, KnnRetriever, choose_token
from ralm.knnlm.metric import l2_distances, rank_by_distance


def _queries(ds, n=64, seed=0):
    rng = np.random.default_rng(seed)
    q = ds.keys[rng.choice(len(ds), n, replace=False)].copy()
    q[n // 2 :] += rng.standard_normal((n - n // 2, ds.dim)).astype(np.float32) * 0.1  # near, not on, entries
    return q


@pytest.mark.parametrize("model", ["tiny-gpt2", "pydocs-gpt"])
def test_alone_equals_batch_and_flat_is_exact(knn_setups, model):
    lm, ds, kbs = knn_setups[model]
    Q = _queries(ds)
    assert kbs["flat"].padded_rows == 3 * len(ds)
    for kind, kb in kbs.items():
        for k in (1, 16, 256, 1024):
            batch = kb.search_vectors(Q, k)
            alone = [kb.search(q, k) for q in Q[:8]] + [kb.search_vectors(Q[40:45], k)[i] for i in range(5)]
            assert alone[:8] == batch[:8] and alone[8:] == batch[40:45], (kind, k)
            for hits in batch:
                assert len(hits) == k
                assert all(e < len(ds) for e, _ in hits)  # padding never returned
                d = [x for _, x in hits]
                assert d == sorted(d)
            if kind == "flat":
                for i in (0, 33, 63):
                    assert batch[i] == rank_by_distance(np.arange(len(ds)), l2_distances(ds.keys, Q[i]), k)


def test_ties_order_by_entry_id():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((50, 8)).astype(np.float32)
    keys = np.concatenate([base, base, base])  # every key three times
    ds = Datastore(keys, np.arange(150) % 7, np.repeat(np.arange(3), 50), {"n_passages": 3})
    kb = KnnRetriever(ds, "flat", pad_to=1000)
    hits = kb.search(base[4], 5)
    assert [e for e, _ in hits[:3]] == [4, 54, 104] and hits[0][1] == 0.0
    assert kb.search_vectors(np.stack([base[4]] * 30), 5)[17] == hits


def test_choose_token_ties_go_to_lowest_id():
    from ralm.config import KnnLMConfig

    p_lm = np.array([0.1, 0.3, 0.3, 0.3])
    vals = np.array([3, 2, 1, 0])
    assert choose_token(p_lm, [], vals, KnnLMConfig(lmbda=0.0)) == 1
    # two neighbours at the same distance with values 2 and 1: p_knn ties, lowest id wins
    assert choose_token(p_lm, [(1, 0.5), (2, 0.5)], vals, KnnLMConfig(lmbda=0.5)) == 1
    assert choose_token(p_lm, [(0, 0.1), (2, 0.5)], vals, KnnLMConfig(lmbda=0.5, temperature=1.0)) == 3
    assert choose_token(p_lm, [(0, 0.1)], vals, KnnLMConfig(lmbda=0.5), mask_token=3) == 1


@pytest.mark.parametrize("scan", ["bf16", "int8"])
@pytest.mark.parametrize("model", ["tiny-gpt2", "pydocs-gpt"])
def test_a_bounded_scan_equals_the_faiss_scan(knn_setups, model, scan):
    """The flat KB gives the same hits with the bf16 or int8 candidate scan as with FAISS, for
    the datastore's own queries (keys, and keys moved a little), alone and in batches, padded."""
    lm, ds, _ = knn_setups[model]
    pad = 2 * len(ds) + 12345  # padding rows in mixed and padding-only blocks
    bf = KnnRetriever(ds, "flat", pad_to=pad, scan=scan)
    fa = KnnRetriever(ds, "flat", pad_to=pad, scan="faiss")
    assert bf.scan_kind.split()[0] == scan and fa.scan_kind == "faiss" and bf.scan is not None and fa.scan is None
    assert bf.n_rows == fa.n_rows == pad and bf.padded_rows == fa.padded_rows == pad
    assert bf.index is None  # no float32 copy of the padding
    Q = _queries(ds, n=24, seed=3)
    for k in (1, 16, 256, 1024):
        want = fa.search_vectors(Q, k)
        assert bf.search_vectors(Q, k) == want, k  # one batch of 24
        assert [bf.search(q, k) for q in Q[:6]] == want[:6], k  # alone
        assert bf.search_vectors(Q[10:13], k) == want[10:13], k  # a batch of 3
        for i in (0, 17):
            assert want[i] == rank_by_distance(np.arange(len(ds)), l2_distances(ds.keys, Q[i]), k)
    assert bf.stats["rescored"] <= bf.stats["candidates"]


@pytest.mark.parametrize("scan", ["bf16", "int8"])
def test_a_bounded_scan_ranks_ties_and_near_ties_exactly(scan):
    """Duplicate keys and keys one float32 ulp apart: the bf16 and int8 paths rank them exactly."""
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((300, 32)) * 4 + 10).astype(np.float32)  # not unit, not centred
    near = base.copy()
    near[:, 7] = np.nextafter(near[:, 7], np.float32(np.inf))
    keys = np.concatenate([base, near, base])
    ds = Datastore(keys, np.arange(len(keys)) % 11, np.repeat(np.arange(3), 300), {"n_passages": 3})
    bf = KnnRetriever(ds, "flat", pad_to=40000, scan=scan)
    fa = KnnRetriever(ds, "flat", pad_to=40000, scan="faiss")
    Q = np.concatenate([base[:20], base[20:40] + np.float32(1e-3)])
    for k in (1, 2, 3, 16, 256):
        got = bf.search_vectors(Q, k)
        assert got == fa.search_vectors(Q, k)
        for i in (0, 25):
            assert got[i] == rank_by_distance(np.arange(len(ds)), l2_distances(keys, Q[i]), k)
    assert [e for e, _ in bf.search(base[4], 3)] == [4, 604, 304]


def test_narrow_candidates_keeps_the_exact_top_k():
    from ralm.knnlm.retriever import narrow_candidates

    rng = np.random.default_rng(2)
    keys = rng.standard_normal((5000, 64)).astype(np.float32)
    keys[100:200] = keys[0]  # exact ties
    keys[200:300] = keys[0] * np.float32(1 + 2**-23)  # near-ties
    for q in (keys[0], keys[0] + np.float32(1e-4), keys[500]):
        ids = np.arange(len(keys))
        for k in (1, 50, 150, 1000):
            kept = narrow_candidates(keys, ids, q, k)
            assert kept.size < len(keys)
            assert rank_by_distance(kept, l2_distances(keys[kept], q), k) == rank_by_distance(
                ids, l2_distances(keys, q), k
            )
