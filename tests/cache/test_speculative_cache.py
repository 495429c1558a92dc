"""The local speculative cache ranks exactly like the KB (same scorer, same tie-breaking)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from cache.speculative import SpeculativeCache
from ralm.retrieval.base import rank_hits

KINDS = ["edr", "adr", "sr"]


def test_basic_operations(retrievers):
    scorer = retrievers["edr"].scorer
    c = SpeculativeCache(scorer)
    assert len(c) == 0 and c.top1(scorer.encode(["x"])[0]) is None and c.search(scorer.encode(["x"])[0], 3) == []
    assert c.add([3, 5, 3]) == 2
    assert c.add([(5, 0.1), (7, 0.2)]) == 1  # hits are accepted too
    assert len(c) == 3 and 3 in c and 7 in c and 4 not in c and "x" not in c
    assert c.doc_ids == [3, 5, 7]
    for i in range(40):  # grows past the initial capacity
        c.add([10 + i])
    assert len(c) == 43
    c.top1(scorer.encode(["python"])[0])
    st = c.stats()
    assert st["inserts"] == 43 and st["lookups"] == 3 and st["duplicates"] == 2 and st["size"] == 43
    c.clear()
    assert len(c) == 0 and 3 not in c
    capped = SpeculativeCache(scorer, capacity=2)
    assert capped.add([1, 2, 3]) == 2 and len(capped) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_cache_ranks_exactly_like_the_kb(kind, retrievers, sample_queries):
    """For ~240 queries: after prefetching the KB top-20 of every 4th query into the cache,
    (1) whenever the KB's top-1 is cached, the cache's top-1 is that document with the
    bit-identical score; (2) the cache's full ranking equals rank_hits of the KB's scores
    restricted to the cached documents."""
    kb = retrievers[kind]
    cache = SpeculativeCache(kb.scorer)
    kb_results = kb.batch_search(sample_queries, 20)
    for res in kb_results[::4]:
        cache.add(res)
    assert len(cache) > 100
    reps = kb.scorer.encode(sample_queries)
    cached = np.array(cache.doc_ids)
    hits_in_cache = 0
    for q, rep, res in zip(sample_queries, reps, kb_results):
        top_kb = res[0]
        assert kb.search(q, 1) == [top_kb]
        top_cache = cache.top1(rep)
        if top_kb[0] in cache:
            hits_in_cache += 1
            assert top_cache == top_kb
            assert top_cache[1].hex() == top_kb[1].hex()
        # KB scores of the cached documents, computed one document at a time
        kb_scores = [kb.scorer.score(rep, kb.scorer.doc_keys([int(d)]))[0] for d in cached]
        assert cache.search(rep, len(cache)) == rank_hits(cached, kb_scores, len(cache))
        # every KB hit that is cached gets the KB's score, bit for bit
        cache_scores = dict(cache.search(rep, len(cache)))
        for d, s in res:
            if d in cache:
                assert cache_scores[d] == s
    assert hits_in_cache >= len(sample_queries) // 4


@pytest.mark.parametrize("kind", KINDS)
def test_insertion_order_does_not_matter(kind, retrievers, sample_queries):
    kb = retrievers[kind]
    docs = sorted({d for res in kb.batch_search(sample_queries[:30], 10) for d, _ in res})
    a, b = SpeculativeCache(kb.scorer), SpeculativeCache(kb.scorer)
    a.add(docs)
    for d in reversed(docs):
        b.add([d])
    for rep in kb.scorer.encode(sample_queries[30:60]):
        assert a.search(rep, 5) == b.search(rep, 5)


@pytest.mark.parametrize("kind", KINDS)
def test_score_function_is_picklable_and_identical(kind, retrievers, sample_queries):
    """Remote caches (coordinators) run the scorer's pure function on keys fetched from the KB."""
    kb = retrievers[kind]
    fn = pickle.loads(pickle.dumps(kb.scorer.score_function()))
    rep = pickle.loads(pickle.dumps(kb.scorer.encode([sample_queries[0]])[0]))
    ids = [d for d, _ in kb.search(sample_queries[0], 20)]
    keys = pickle.loads(pickle.dumps(kb.scorer.doc_keys(ids)))
    assert list(fn(rep, keys)) == list(
        kb.scorer.score(kb.scorer.encode([sample_queries[0]])[0], kb.scorer.doc_keys(ids))
    )
    assert list(fn(rep, keys)) == [s for _, s in kb.search(sample_queries[0], 20)]
