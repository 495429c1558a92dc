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
    assert all(len({k for _, k in calls[i : i + 1]}) == 1 for i in range(len(calls)))
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
    assert sum(len(c[0]) for c in calls) < 12  # "same" de-duplicated within batches


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


def test_merge_k_searches_a_mixed_batch_once_at_its_largest_k():
    """On a KB whose top-k is a prefix of its top-K (``merge_k``), calls with k = 1, 3 and 5
    that arrive together are one search at k = 5, each answer cut to its own k and equal to
    its own search; without ``merge_k`` each k is searched separately."""
    ref = fake_kb()[0]
    for merge, expected in ((True, [5]), (False, [1, 3, 5])):
        search, calls = fake_kb()
        b = VerificationBatcher(search, window_ms=30, max_batch=64, merge_k=merge)

        async def main(b=b):
            return await asyncio.gather(
                b.submit(["a", "b"], 1), b.submit(["b", "c"], 3), b.submit(["d"], 5), b.submit(["a"], 1)
            )

        got = run(main())
        assert got == [run(ref(["a", "b"], 1)), run(ref(["b", "c"], 3)), run(ref(["d"], 5)), run(ref(["a"], 1))]
        assert sorted(k for _, k in calls) == expected
        if merge:
            assert calls[0][0] == ("a", "b", "c", "d")  # each query once


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


def test_max_inflight_bounds_concurrent_searches_and_can_change_between_batches():
    """At most max_inflight searches run at once; lowering it to 1 serialises the next batches
    (so the waiting submissions pool into bigger batches); results are unchanged either way."""
    state = {"now": 0, "peak": 0}

    async def search(queries, k):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return await fake_kb()[0](queries, k)

    b = VerificationBatcher(search, window_ms=0, max_batch=1, max_inflight=3)

    async def burst(tag):
        return await asyncio.gather(*(b.submit([f"{tag}{i}"], 2) for i in range(8)))

    async def main():
        first = await burst("a")
        peak3 = state["peak"]
        state["peak"] = 0
        b.set_max_inflight(1)
        second = await burst("b")
        return first, peak3, second

    first, peak3, second = run(main())
    assert peak3 == 3 and state["peak"] == 1 and b.max_inflight == 1
    ref = fake_kb()[0]
    assert first == [run(ref([f"a{i}"], 2)) for i in range(8)]
    assert second == [run(ref([f"b{i}"], 2)) for i in range(8)]
    with pytest.raises(ValueError, match="max_inflight"):
        b.set_max_inflight(0)


def test_a_batch_goes_as_soon_as_every_announced_request_is_waiting():
    """Window 5 s: announced requests are searched as soon as all of them have a call queued,
    a lone announced request at once, and a request that ends stops being waited for. Without
    announcements (or with the rule off) the window applies. Results never change."""
    search, calls = fake_kb()
    ref = fake_kb()[0]
    b = VerificationBatcher(search, window_ms=5000, max_batch=64)

    async def timed(coro):
        t0 = time.perf_counter()
        res = await coro
        return res, time.perf_counter() - t0

    async def main():
        b.begin("r1")
        alone = await timed(b.submit(["solo"], 2, "r1"))
        b.begin("r2")

        async def later():
            await asyncio.sleep(0.05)
            return await b.submit(["two"], 2, "r2")

        pair = await timed(asyncio.gather(b.submit(["one"], 2, "r1"), later()))
        n_pair = len(calls)
        waiting = asyncio.ensure_future(b.submit(["left"], 2, "r1"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # r2 is still in flight: wait for it
        b.end("r2")
        left = await timed(waiting)
        b.end("r1")
        return alone, pair, n_pair, left

    alone, pair, n_pair, left = run(main())
    assert alone[0] == run(ref(["solo"], 2)) and alone[1] < 1.0
    assert pair[0] == [run(ref(["one"], 2)), run(ref(["two"], 2))] and pair[1] < 1.0
    assert n_pair == 2 and calls[1][0] == ("one", "two")  # one search for both requests
    assert left[0] == run(ref(["left"], 2)) and left[1] < 1.0
    assert b.stats.early_flushes == 3 and b.active_requests == 0

    anon = VerificationBatcher(fake_kb()[0], window_ms=150, max_batch=64)
    off = VerificationBatcher(fake_kb()[0], window_ms=150, max_batch=64, flush_when_all_waiting=False)

    async def unannounced_and_off():
        a = await timed(anon.submit(["anon"], 1))  # nobody announced: the window
        off.begin("r1")
        o = await timed(off.submit(["x"], 1, "r1"))  # rule off: the window
        return a, o

    a, o = run(unannounced_and_off())
    assert a[1] >= 0.14 and o[1] >= 0.14


def test_a_speculating_request_is_not_waited_for_until_its_next_call():
    """Window 5 s, two announced requests. r2 opened a speculation window (``away``): r1's
    call is searched at once instead of waiting for r2. r2's own call (its verification) ends
    its away state: r1's next call waits for r2 again. With ``wait_for_speculating`` r1's
    first call is held for r2 too (here until r2 ends). Results never change."""
    search, calls = fake_kb()
    ref = fake_kb()[0]

    async def timed(coro):
        t0 = time.perf_counter()
        res = await coro
        return res, time.perf_counter() - t0

    async def scenario(b: VerificationBatcher):
        b.begin("r1")
        b.begin("r2")
        b.away("r2")
        first = asyncio.ensure_future(timed(b.submit(["one"], 2, "r1")))
        await asyncio.sleep(0.2)
        held = not first.done()
        b.end("r2")  # (frees r1's call if it was held)
        one = await first
        b.begin("r2")
        b.away("r2")
        # r2's verification, then r1's call: one batch (both waiting)
        pair = await asyncio.gather(b.submit(["verify"], 2, "r2"), b.submit(["two"], 2, "r1"))
        later = asyncio.ensure_future(b.submit(["three"], 2, "r1"))
        await asyncio.sleep(0.2)
        waits_again = not later.done()  # r2 is no longer away: r1 waits for it
        b.end("r2")
        three = await later
        b.end("r1")
        return held, one, pair, waits_again, three

    held, one, pair, waits_again, three = run(scenario(VerificationBatcher(search, window_ms=5000, max_batch=64)))
    assert not held and one[1] < 0.2 and one[0] == run(ref(["one"], 2))
    assert pair == [run(ref(["verify"], 2)), run(ref(["two"], 2))]
    assert waits_again and three == run(ref(["three"], 2))
    assert [c[0] for c in calls] == [("one",), ("verify", "two"), ("three",)]

    b = VerificationBatcher(fake_kb()[0], window_ms=5000, max_batch=64, wait_for_speculating=True)
    held, one, _, _, _ = run(scenario(b))
    assert held and one[1] >= 0.2 and one[0] == run(ref(["one"], 2))
    assert b.active_requests == 0 and not b._away


def test_requests_split_across_batches_merge_into_one_batch():
    """r1 starts alone and is searched at once; r2 arrives during that search. A request being
    searched is not waiting, so r2 waits for r1's next call (not for the window) and from then
    on both share every batch; counting r1 as waiting would make them alternate forever."""
    sizes: list[int] = []

    async def search(queries, k):
        sizes.append(len(queries))
        await asyncio.sleep(0.03)
        return await fake_kb()[0](queries, k)

    b = VerificationBatcher(search, window_ms=2000, max_batch=64, max_inflight=1)
    rounds = 6

    async def client(tag, delay):
        await asyncio.sleep(delay)
        b.begin(tag)
        out = []
        for i in range(rounds):
            out.append(await b.submit([f"{tag}-{i}"], 1, tag))
            await asyncio.sleep(0.005)  # "generation" between two KB calls
        b.end(tag)
        return out

    async def main():
        t0 = time.perf_counter()
        res = await asyncio.gather(client("r1", 0.0), client("r2", 0.01))
        return res, time.perf_counter() - t0

    (r1, r2), dt = run(main())
    ref = fake_kb()[0]
    assert r1 == [run(ref([f"r1-{i}"], 1)) for i in range(rounds)]
    assert r2 == [run(ref([f"r2-{i}"], 1)) for i in range(rounds)]
    assert sizes[0] == 1 and sizes[1:rounds] == [2] * (rounds - 1)  # merged after r1's first call
    assert dt < 1.5  # no batch waited out the 2 s window


# --------------------------------------------------------------------------- the actor
@pytest.fixture(scope="module")
def verifier(ray_local, index_dirs, fixture_corpus, retriever_configs):
    import ray

    from actors.shard import prepare_shards, start_shards
    from actors.verifier import verifier_actor_class

    rcfg = retriever_configs["edr"]
    specs = prepare_shards(rcfg, fixture_corpus, index_dirs["edr"], 2)
    shards = start_shards(specs, num_cpus=0.05)
    v = verifier_actor_class(0.05).remote(
        "edr", shards, [(s.lo, s.hi) for s in specs], rcfg.model_dump(mode="json"), 25.0, 64, True
    )
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
    refs = [verifier.verify.remote(qs[2 * i : 2 * i + 2], 1 if i % 2 else 20) for i in range(12)]
    got = ray.get(refs)
    for i, res in enumerate(got):
        k = 1 if i % 2 else 20
        assert res == [full.search(q, k) for q in qs[2 * i : 2 * i + 2]]
    st = ray.get(verifier.stats.remote())
    assert st["submissions"] == 12 and st["max_batch_submissions"] > 1
    # exact dense: a batch with k = 1 and k = 20 is one search at k = 20 (answers cut above)
    assert st["searches"] == st["batches"]
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


def test_the_verifier_reports_its_shards_start_up_batch_curve(ray_local, index_dirs, fixture_corpus, retriever_configs):
    """An exact-dense shard large enough to be timed (padded past the 64k-row timing block)
    reports each batch size's cost relative to one query; the verifier hands it on (what
    each request's stride scheduler reads), and an untimed KB reports none."""
    import ray

    from actors.shard import prepare_shards, start_shards
    from actors.verifier import verifier_actor_class
    from ralm.retrieval.scan_choice import TIMING_BATCHES, TIMING_ROWS

    curves = {}
    for pad in (0, TIMING_ROWS + 1000):
        rcfg = retriever_configs["edr"].model_copy(update={"pad_to": pad})
        specs = prepare_shards(rcfg, fixture_corpus, index_dirs["edr"], 1)
        shards = start_shards(specs, num_cpus=0.05)
        v = verifier_actor_class(0.05).remote(
            "edr", shards, [(s.lo, s.hi) for s in specs], rcfg.model_dump(mode="json")
        )
        curves[pad] = ray.get(v.cost_curve.remote())
        info = ray.get(v.shard_infos.remote())[0]
        assert info["dense_scan_batch_cost"] == curves[pad]
        for a in [v, *shards]:
            ray.kill(a)
    assert curves[0] is None  # a small index is not timed
    timed = curves[TIMING_ROWS + 1000]
    assert sorted(timed) == list(TIMING_BATCHES) and timed[1] == 1.0
    assert all(c > 0 for c in timed.values())
