"""Cross-request verification batching never changes a result.

The batcher itself is tested with a plain asyncio search function (no Ray); the verifier
actor with real sharded EDR shards, many concurrent callers and per-query comparisons.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from actors.verifier import VerificationBatcher


def fake_kb(delay: float = 0.0):
    """A deterministic KB: hits depend on the query text and k only; records its calls."""
    calls: list[tuple[tuple[str, ...], int]] = []

    async def search(queries, k):
        calls.append((tuple(queries), k))
        if delay:
            await asyncio.sleep(delay)
        out = []
        for q in queries:
            h = sum(map(ord, q))
            out.append([((h * (j + 7)) % 97, 1.0 / (j + 1)) for j in range(k)])
        return out

    return search, calls


def run(coro):
    return asyncio.run(coro)


def test_batched_results_equal_single_results():
    search, calls = fake_kb(delay=0.005)
    b = VerificationBatcher(search, window_ms=20, max_batch=64)
    subs = [([f"q{i}-{j}" for j in range(1 + i % 3)], 1 + i % 2) for i in range(20)]

    async def main():
        return await asyncio.gather(*(b.submit(qs, k) for qs, k in subs))

    got = run(main())
    ref_search, _ = fake_kb()
    for (qs, k), res in zip(subs, got):
        assert res == run(ref_search(qs, k))
    # 20 submissions went out in very few searches, one per distinct k
    assert b.stats.batches < 5 and b.stats.searches <= 2 * b.stats.batches
    assert all(len({k for _, k in calls[i:i + 1]}) == 1 for i in range(len(calls)))
    assert b.stats.max_batch_submissions > 1


def test_max_batch_caps_a_batch_and_duplicates_are_searched_once():
    search, calls = fake_kb()
    b = VerificationBatcher(search, window_ms=50, max_batch=4)

    async def main():
        return await asyncio.gather(*(b.submit(["same", f"x{i}"], 3) for i in range(6)))

    got = run(main())
    assert all(len(r) == 2 for r in got)
    assert all(r[0] == got[0][0] for r in got)
    assert max(len(c[0]) for c in calls) <= 4
    assert b.stats.max_batch_queries <= 4
    assert sum(len(c[0]) for c in calls) < 12          # "same" de-duplicated within batches


def test_window_flushes_a_lonely_query():
    search, calls = fake_kb()
    b = VerificationBatcher(search, window_ms=30, max_batch=64)

    async def main():
        t0 = time.perf_counter()
        res = await b.submit(["alone"], 2)
        return res, time.perf_counter() - t0

    res, dt = run(main())
    assert res == run(fake_kb()[0](["alone"], 2))
    assert 0.02 <= dt < 1.0
    assert len(calls) == 1


def test_disabled_batching_searches_each_submission_alone():
    search, calls = fake_kb(delay=0.002)
    b = VerificationBatcher(search, window_ms=50, max_batch=64, enabled=False)

    async def main():
        return await asyncio.gather(*(b.submit([f"q{i}"], 1) for i in range(5)))

    got = run(main())
    assert len(calls) == 5 and [c[0] for c in calls] == [(f"q{i}",) for i in range(5)]
    assert got == [run(fake_kb()[0]([f"q{i}"], 1)) for i in range(5)]


def test_errors_reach_every_waiting_request_and_the_batcher_recovers():
    state = {"fail": True}

    async def search(queries, k):
        if state["fail"]:
            raise RuntimeError("shard down")
        return [[(1, 1.0)] for _ in queries]

    b = VerificationBatcher(search, window_ms=10, max_batch=64)

    async def main():
        res = await asyncio.gather(*(b.submit([f"q{i}"], 1) for i in range(3)), return_exceptions=True)
        state["fail"] = False
        ok = await b.submit(["later"], 1)
        return res, ok

    res, ok = run(main())
    assert all(isinstance(r, RuntimeError) for r in res)
    assert ok == [[(1, 1.0)]]


# --------------------------------------------------------------------------- the actor
@pytest.fixture(scope="module")
def verifier(ray_local, index_dirs, fixture_corpus, retriever_configs):
    import ray

    from actors.shard import prepare_shards, start_shards
    from actors.verifier import verifier_actor_class

    rcfg = retriever_configs["edr"]
    specs = prepare_shards(rcfg, fixture_corpus, index_dirs["edr"], 2)
    shards = start_shards(specs, num_cpus=0.05)
    v = verifier_actor_class(0.05).remote("edr", shards, [(s.lo, s.hi) for s in specs],
                                          rcfg.model_dump(mode="json"), 25.0, 64, True)
    ray.get(v.ping.remote())
    yield v
    for a in [v, *shards]:
        ray.kill(a)


def test_verifier_actor_batches_across_callers_without_changing_results(verifier, retrievers, sample_queries):
    import ray

    qs = sample_queries[:24]
    full = retrievers["edr"]
    ray.get(verifier.stats.remote(True))
    # 12 "requests" submit at once, 2 queries each, k=1 and k=20 alternating
    refs = [verifier.verify.remote(qs[2 * i:2 * i + 2], 1 if i % 2 else 20) for i in range(12)]
    got = ray.get(refs)
    for i, res in enumerate(got):
        k = 1 if i % 2 else 20
        assert res == [full.search(q, k) for q in qs[2 * i:2 * i + 2]]
    st = ray.get(verifier.stats.remote())
    assert st["submissions"] == 12 and st["max_batch_submissions"] > 1
    # switching batching off changes nothing either
    ray.get(verifier.configure.remote(batching=False))
    assert ray.get(verifier.verify.remote(qs[:3], 5)) == full.batch_search(qs[:3], 5)
    ray.get(verifier.configure.remote(batching=True))


def test_verifier_serves_the_kb_scorer(verifier, retrievers, sample_queries):
    import ray

    full = retrievers["edr"]
    reps = ray.get(verifier.encode.remote(sample_queries[:4]))
    assert all(np.array_equal(a, b) for a, b in zip(reps, full.scorer.encode(sample_queries[:4])))
    keys = ray.get(verifier.doc_keys.remote([3, 200, 150]))
    assert all(np.array_equal(a, b) for a, b in zip(keys, full.scorer.doc_keys([3, 200, 150])))
    fn = ray.get(verifier.score_function.remote())
    assert np.array_equal(fn(reps[0], keys), full.scorer.score(reps[0], keys))
