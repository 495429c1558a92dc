"""Sharded retrieval equals the unsharded index, and survives a shard's death mid-request.

EDR: every shard re-scores with the same float64 function of the same float32 vectors.
SR: shards score with the *global* BM25 statistics (dfs phase through the router), with
the candidate bound converted from local to global scores; checked against the unsharded
SparseRetriever and against brute force over the whole corpus, also with a tiny
candidate margin so that the bound-driven expansion does the work.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from actors.shard import prepare_shards, shard_bounds, start_shards
from actors.shard_router import ShardedRetriever
from ralm.config import RequestConfig
from ralm.retrieval.base import rank_hits
from ralm.seq import run_seq

pytestmark = pytest.mark.usefixtures("ray_local")

KS = (1, 5, 20)


@pytest.fixture(scope="module")
def queries(sample_queries):
    return sample_queries[:30] + sample_queries[-10:]


@pytest.fixture(scope="module")
def routers(ray_local, index_dirs, fixture_corpus, retriever_configs, dense_encoder):
    """(kind, n_shards, margin) -> ShardedRetriever (started once per module)."""
    made: dict = {}

    def get(kind: str, n: int, margin: int | None = None) -> ShardedRetriever:
        key = (kind, n, margin)
        if key not in made:
            rcfg = retriever_configs[kind]
            if margin is not None:
                rcfg = rcfg.model_copy(update={"rerank_margin": margin})
            specs = prepare_shards(rcfg, fixture_corpus, index_dirs[kind], n)
            actors = start_shards(specs, num_cpus=0.05)
            made[key] = ShardedRetriever(kind, actors, [(s.lo, s.hi) for s in specs], rcfg, encoder=dense_encoder)
        return made[key]

    yield get
    import ray

    for r in made.values():
        for a in r.shards:
            ray.kill(a, no_restart=True)


def test_shard_bounds():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ValueError):
        shard_bounds(2, 3)


@pytest.mark.parametrize("kind,n", [("edr", 3), ("sr", 2)])
def test_sharded_equals_unsharded(kind, n, routers, retrievers, queries):
    sharded, full = routers(kind, n), retrievers[kind]
    for k in KS:
        assert sharded.batch_search(queries, k) == full.batch_search(queries, k), (kind, n, k)
    import ray

    info = ray.get(sharded.shards[0].info.remote())
    if kind == "edr":  # an exact dense shard names its candidate paths (a small slice: untimed)
        assert info["dense_scan"] in ("faiss", "bf16") or info["dense_scan"].startswith("int8")
        assert info["dense_scan_timings_ms"] is None
    else:
        assert "dense_scan" not in info


def test_sharded_bm25_with_tiny_margin_equals_brute_force(routers, retrievers, queries, fixture_corpus):
    """margin 1: shards expand on the converted bound; still the exact global top-k."""
    sharded, full = routers("sr", 3, margin=1), retrievers["sr"]
    all_ids = np.arange(len(fixture_corpus))
    for k in (1, 8):
        got = sharded.batch_search(queries, k)
        for q, hits in zip(queries, got):
            rep = full.scorer.encode([q])[0]
            brute = rank_hits(all_ids, full.scorer.score_ids(rep, all_ids), k)
            assert hits == brute, q
    infos = sharded.infos()
    assert sum(i["expansions"] for i in infos) > 0  # the bound did some work


def test_sharded_scorer_is_the_kb_scorer(routers, retrievers, queries, fixture_corpus):
    n_docs = len(fixture_corpus)
    for kind in ("edr", "sr"):
        sharded, full = routers(kind, 3 if kind == "edr" else 2), retrievers[kind]
        a, b = sharded.scorer.encode(queries[:10]), full.scorer.encode(queries[:10])
        if kind == "edr":
            assert all(np.array_equal(x, y) for x, y in zip(a, b))
        else:
            assert a == b
        ids = [0, 57, 150, n_docs - 1, 99, 100]
        ka, kb = sharded.scorer.doc_keys(ids), full.scorer.doc_keys(ids)
        for x, y in zip(ka, kb):
            assert np.array_equal(x, y) if kind == "edr" else x == y
        # the cache's scores through the router's scorer are the KB's, bit for bit
        for q in queries[:5]:
            rep = full.scorer.encode([q])[0]
            assert np.array_equal(sharded.scorer.score(rep, ka), full.scorer.score(rep, kb))


@pytest.mark.parametrize("kind", ["edr", "sr", "adr"])
def test_batch_independence(kind, routers, queries):
    r = routers(kind, 2)
    batch = (queries * 2)[:64]
    together = r.batch_search(batch, 5)
    alone = [r.search(q, 5) for q in batch[:12]]
    assert together[:12] == alone


def test_sharded_adr_is_a_consistent_kb(routers, retrievers, queries):
    """Per-shard HNSW graphs form another approximate KB: valid, sorted, mostly the exact top-1."""
    r = routers("adr", 2)
    exact = retrievers["edr"].batch_search(queries, 1)
    got = r.batch_search(queries, 5)
    for hits in got:
        assert len(hits) == 5 and hits == sorted(hits, key=lambda h: (-h[1], h[0]))
    agree = sum(g[0] == e[0] for g, e in zip(got, exact)) / len(queries)
    assert agree >= 0.9


def test_shard_killed_mid_request_still_exact(routers, retrievers, local_generator, fixture_questions):
    """Kill a shard (Ray restarts it) while a RaLMSeq request is running on the sharded KB."""
    import ray

    sharded = routers("edr", 3)
    victim = sharded.shards[1]
    pid_before = ray.get(victim.ping.remote())
    req = RequestConfig(max_new_tokens=48, generation_stride=2)
    q = fixture_questions[3]
    expected = run_seq(q, local_generator, retrievers["edr"], req)

    class KillingKB:
        """The sharded KB, killing shard 1 concurrently with the 4th search."""

        name, scorer = sharded.name, sharded.scorer
        calls = 0

        def search(self, query, k):
            return self.batch_search([query], k)[0]

        def batch_search(self, qs, k):
            KillingKB.calls += 1
            if KillingKB.calls == 4:
                threading.Thread(target=ray.kill, args=(victim,), kwargs={"no_restart": False}).start()
            return sharded.batch_search(qs, k)

    got = run_seq(q, local_generator, KillingKB(), req)
    assert got.tokens == expected.tokens
    assert got.stats.doc_ids == expected.stats.doc_ids
    assert KillingKB.calls == expected.stats.kb_calls > 4
    assert ray.get(victim.ping.remote()) != pid_before  # restarted, slice reloaded
    assert sharded.batch_search(["json dumps"], 5) == retrievers["edr"].batch_search(["json dumps"], 5)
