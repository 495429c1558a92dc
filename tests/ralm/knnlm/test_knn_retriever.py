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
    q[n // 2:] += rng.standard_normal((n - n // 2, ds.dim)).astype(np.float32) * 0.1   # near, not on, entries
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
                assert all(e < len(ds) for e, _ in hits)            # padding never returned
                d = [x for _, x in hits]
                assert d == sorted(d)
            if kind == "flat":
                for i in (0, 33, 63):
                    assert batch[i] == rank_by_distance(np.arange(len(ds)), l2_distances(ds.keys, Q[i]), k)


def test_ties_order_by_entry_id():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((50, 8)).astype(np.float32)
    keys = np.concatenate([base, base, base])                       # every key three times
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
