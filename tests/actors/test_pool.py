"""The coordinator pool without Ray: fake coordinator handles whose calls can be made to
fail (a dead actor) or never answer (an actor on a vanished node).

It grows then queues, bounds its queue, stops a cancelled caller's work, and — what a lost
node does to it — notices a leased coordinator that no longer answers, drops idle ones that
died with it, restarts enough coordinators for the requests waiting, gives up on one that
cannot be placed with a retryable 503, and keeps trying to restore its size."""

from __future__ import annotations

import asyncio

import pytest

from actors.pool import CoordinatorPool
from ralm.errors import Overloaded


class Coord:
    """A fake coordinator: ``alive`` False = its node is gone (calls never answer)."""

    made = 0

    def __init__(self) -> None:
        Coord.made += 1
        self.n = Coord.made
        self.alive = True

    async def call(self, value):
        if not self.alive:
            await asyncio.Event().wait()  # never answers
        await asyncio.sleep(0.01)
        return value

    def __repr__(self) -> str:
        return f"Coord({self.n}{'' if self.alive else ', dead'})"


async def _ping(h: Coord) -> None:
    await h.call(None)


def _pool(size=2, max_size=4, **kw) -> CoordinatorPool:
    async def ready(h: Coord) -> None:
        await h.call(None)

    kw.setdefault("probe", _ping)
    kw.setdefault("probe_interval_s", 0.05)
    kw.setdefault("probe_timeout_s", 0.3)
    return CoordinatorPool(Coord, ready, size=size, max_size=max_size, **kw)


def test_pool_grows_then_queues():
    from actors.pool import CoordinatorPool

    made = []

    def factory():
        made.append(object())
        return made[-1]

    async def ready(_):
        await asyncio.sleep(0)

    async def main():
        pool = await CoordinatorPool(factory, ready, size=2, max_size=3).start()
        a, b, c = await pool.acquire(), await pool.acquire(), await pool.acquire()
        assert len({id(a), id(b), id(c)}) == 3 and pool.stats.created == 3
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # at max_size: waits for a release
        pool.release(b)
        assert await waiter is b
        assert pool.stats.waits == 1
        for h in (a, b, c):
            pool.release(h)
        assert pool.stats.idle == 3

    asyncio.run(main())


def test_pool_bounds_its_queue_and_refuses_beyond_it_with_a_retry_hint():
    from actors.pool import CoordinatorPool
    from ralm.errors import Overloaded

    async def ready(_):
        return None

    async def main():
        pool = await CoordinatorPool(object, ready, size=1, max_size=1, max_waiting=2).start()
        held = await pool.acquire()
        waiters = [asyncio.ensure_future(pool.acquire()) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert pool.stats.waiting == 2
        with pytest.raises(Overloaded, match="at capacity") as e:
            await pool.acquire()  # refused at once, not queued
        assert 1.0 <= e.value.retry_after_s <= 60.0
        assert pool.stats.rejected == 1 and pool.stats.waiting == 2
        pool.release(held)
        h = await waiters[0]
        pool.release(h)
        pool.release(await waiters[1])
        assert pool.stats.waiting == 0 and pool.stats.idle == 1

    asyncio.run(main())


def test_a_cancelled_caller_stops_its_request_and_the_coordinator_returns_only_when_free():
    """The deadline / client-gone path: ``cancel(coordinator)`` is called, the caller sees the
    cancellation at once, and the coordinator is not leased again while its work still runs."""
    from actors.pool import CoordinatorPool

    async def ready(_):
        return None

    async def main():
        pool = await CoordinatorPool(object, ready, size=1, max_size=1).start()
        stop = asyncio.Event()
        told = []

        async def work(h):
            await stop.wait()  # the coordinator notices the cancel flag between two steps
            return "stopped"

        def cancel(h):
            told.append(h)
            stop.set()

        stop_later = asyncio.Event()

        async def slow_work(h):
            await stop_later.wait()
            return "late"

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool.run(slow_work, cancel=lambda h: told.append(h)), 0.05)
        assert len(told) == 1 and pool.stats.cancelled == 1
        nxt = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.02)
        assert not nxt.done()  # still busy with the cancelled request's work
        stop_later.set()
        h = await asyncio.wait_for(nxt, 1)
        pool.release(h)
        task = asyncio.ensure_future(pool.run(work, cancel=cancel))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(told) == 2 and stop.is_set()
        h = await asyncio.wait_for(pool.acquire(), 1)  # back once the work ended
        pool.release(h)

    asyncio.run(main())


def test_a_coordinator_that_stops_answering_mid_request_is_replaced_and_the_request_retried():
    async def main():
        pool = await _pool(size=2, max_size=2).start()
        first = []

        async def work(h):
            first.append(h)
            if len(first) == 1:
                h.alive = False  # its node vanishes while the request runs: the call never returns
            return await h.call(f"answer from {h.n}")

        res = await asyncio.wait_for(pool.run(work), 5)
        assert res == f"answer from {first[1].n}" and first[1] is not first[0]
        assert pool.stats.lost >= 1 and pool.stats.replaced >= 1
        await asyncio.sleep(0.5)  # the replacement starts in the background
        assert pool.stats.size == 2 and pool.stats.idle == 2
        assert all(h.alive for h in pool._all) and first[0] not in pool._all

    asyncio.run(main())


def test_one_death_makes_the_pool_drop_the_idle_coordinators_that_died_with_it():
    """A node held several coordinators: the first request to hit a dead one triggers a
    ping of the idle ones, so later requests do not each lose a try on a dead one."""

    async def main():
        pool = await _pool(size=4, max_size=4).start()
        for h in list(pool._idle._queue):
            h.alive = False
        tries = []

        async def work(h):
            tries.append(h)
            return await h.call("ok")

        assert await asyncio.wait_for(pool.run(work, retries=4), 5) == "ok"
        await asyncio.sleep(0.5)
        assert pool.stats.size == 4 and pool.stats.idle == 4 and all(h.alive for h in pool._all)
        results = await asyncio.gather(*(pool.run(work, retries=0) for _ in range(4)))  # no retry needed now
        assert results == ["ok"] * 4

    asyncio.run(main())


def test_requests_waiting_at_max_size_get_new_coordinators_when_the_busy_ones_die():
    """The hang this guards against: every coordinator leased, more requests waiting, then
    all the leased ones vanish; the waiters must not wait for a release that never comes."""

    async def main():
        pool = await _pool(size=2, max_size=3).start()
        gate = asyncio.Event()

        async def work(h):
            await gate.wait()
            return await h.call(h.n)

        running = [asyncio.ensure_future(pool.run(work)) for _ in range(3)]
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(pool.run(work)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert pool.stats.waiting == 3 and pool.stats.size == 3
        for h in list(pool._all):
            h.alive = False
        gate.set()
        done = await asyncio.wait_for(asyncio.gather(*running, *waiting), 10)
        assert len(done) == 6 and pool.stats.waiting == 0

    asyncio.run(main())


def test_a_coordinator_that_cannot_be_placed_gives_a_retryable_503_and_the_pool_keeps_trying():
    """No node can take a coordinator (its node is gone, the replacement not yet there): the
    request that needed a new one gets Overloaded at once after ready_timeout_s, and the
    pool restores its size once a node is back."""
    node_back = asyncio.Event()

    async def ready(h: Coord) -> None:
        await node_back.wait()

    async def main():
        pool = CoordinatorPool(
            Coord,
            ready,
            size=1,
            max_size=2,
            probe=_ping,
            probe_interval_s=0.05,
            probe_timeout_s=0.1,
            ready_timeout_s=0.2,
        )
        node_back.set()
        await pool.start()
        node_back.clear()
        held = await pool.acquire()
        with pytest.raises(Overloaded, match="no coordinator could be started") as e:
            await pool.acquire()  # would grow the pool, but nothing can be placed
        assert e.value.retry_after_s >= 1
        assert pool.stats.size == 1  # the unready one is not counted
        held.alive = False
        replacing = asyncio.ensure_future(pool.replace(held))
        await asyncio.sleep(0.5)
        assert pool.stats.start_failures >= 1 and pool.stats.size <= 1
        node_back.set()
        await asyncio.wait_for(replacing, 15)
        assert pool.stats.size == 1 and pool.stats.idle == 1

    asyncio.run(main())


def test_a_request_whose_coordinators_keep_dying_gets_a_retryable_503_not_a_hang():
    async def main():
        pool = await _pool(size=1, max_size=1).start()

        async def work(h):
            h.alive = False
            return await h.call("never")

        with pytest.raises(Overloaded, match="lost 2 times"):
            await asyncio.wait_for(pool.run(work, retries=1), 5)

    asyncio.run(main())


def test_a_dropped_handle_that_is_no_ray_actor_is_not_killed_through_ray(monkeypatch):
    """``ray.kill`` on anything but a live actor handle starts a local Ray instance (Ray's
    auto-init) inside the pool's event loop and blocks it for seconds: a request then timed
    out in CI. The pool drops such a handle without calling Ray."""
    import ray

    calls: list = []
    monkeypatch.setattr(ray, "kill", lambda handle, **kw: calls.append(handle))
    pool = _pool(size=1, max_size=1)
    dead = Coord()
    pool._all.append(dead)
    pool._discard(dead)
    assert calls == [] and dead not in pool._all


def _chunks(h: Coord, values, stop: asyncio.Event | None = None, dies_after: int | None = None):
    """A coordinator's stream: one ready awaitable per chunk, as Ray's streaming ObjectRefs; ``stop``
    ends it early (the coordinator saw its cancel flag), ``dies_after`` loses its node."""

    async def gen():
        for i, v in enumerate(values):
            if stop is not None and stop.is_set():
                return
            if dies_after is not None and i == dies_after:
                h.alive = False
            done = asyncio.get_running_loop().create_future()
            done.set_result(await h.call(v))  # a ref arrives once its chunk is computed
            yield done

    return gen()


def test_a_stream_holds_its_coordinator_until_it_is_read_to_its_end():
    async def main():
        pool = await _pool(size=1, max_size=1).start()
        stream = pool.stream(lambda h: _chunks(h, ["a", "b", "c"]))
        assert await anext(stream) is None  # leased: admitted
        nxt = asyncio.ensure_future(pool.acquire())
        got = [c async for c in stream]
        assert got == ["a", "b", "c"]
        h = await asyncio.wait_for(nxt, 1)  # given back at the end, not before
        pool.release(h)
        assert pool.stats.cancelled == 0 and pool.stats.replaced == 0

    asyncio.run(main())


def test_a_stream_closed_early_stops_its_request_and_frees_the_coordinator_once_stopped():
    """The client went away after the first chunk: ``cancel(coordinator)`` is called, and the
    coordinator is leased again only after its stream has ended."""

    async def main():
        pool = await _pool(size=1, max_size=1).start()
        stop, told = asyncio.Event(), []

        def cancel(h):
            told.append(h)
            asyncio.get_running_loop().call_later(0.05, stop.set)  # the next step notices it

        stream = pool.stream(lambda h: _chunks(h, range(1000), stop), cancel=cancel)
        assert await anext(stream) is None and await anext(stream) == 0
        await stream.aclose()
        assert len(told) == 1 and pool.stats.cancelled == 1
        nxt = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.02)
        assert not nxt.done()  # still draining the cancelled stream
        h = await asyncio.wait_for(nxt, 2)
        assert h is told[0]
        pool.release(h)

    asyncio.run(main())


def test_a_stream_whose_coordinator_is_lost_fails_with_a_retryable_503():
    async def main():
        pool = await _pool(size=1, max_size=1).start()
        stream = pool.stream(lambda h: _chunks(h, ["a", "b", "c"], dies_after=1))
        assert await anext(stream) is None and await anext(stream) == "a"
        with pytest.raises(Overloaded, match="coordinator running this stream was lost") as e:
            await asyncio.wait_for(anext(stream), 5)
        assert e.value.retry_after_s >= 1
        assert pool.stats.lost == 1 and pool.stats.replaced == 1
        await asyncio.sleep(0.3)  # the replacement starts in the background
        assert pool.stats.size == 1 and all(h.alive for h in pool._all)

    asyncio.run(main())
