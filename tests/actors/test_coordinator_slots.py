"""Slots of coordinator hosts without Ray: fake host actors whose ``.remote()`` calls are
coroutines. Slots fill a host before a new one starts, a host's ``ready`` is paid once, a
dead host is ended and never given a slot again, and the pool keeps free slots ahead of
demand (``headroom``) so a burst never waits for a start."""

from __future__ import annotations

import asyncio

import pytest

from actors.pool import CoordinatorPool, SlotFactory


class _Method:
    def __init__(self, host: FakeHost, name: str):
        self.host, self.name = host, name

    def remote(self, *args):
        self.host.calls.append((self.name, *args))
        return self.host.answer(self.name)


class FakeHost:
    """A host actor: ``dead`` makes every call fail (an actor death), ``delay`` is the time a
    ``ready`` takes (a process start)."""

    def __init__(self, name: str, delay: float = 0.0):
        self.name, self.delay, self.dead, self.calls = name, delay, False, []
        self.ready = _Method(self, "ready")
        self.ping = _Method(self, "ping")

    async def answer(self, method: str):
        if self.dead:
            raise RuntimeError(f"{self.name} died")
        if method == "ready":
            await asyncio.sleep(self.delay)
        return True


def _factory(slots_per_host=3, delay=0.0):
    made: list[FakeHost] = []
    killed: list[FakeHost] = []

    def make_host(name):
        made.append(FakeHost(name, delay))
        return made[-1]

    return SlotFactory(make_host, slots_per_host, kill=killed.append), made, killed


def test_slots_fill_a_host_before_a_new_one_starts():
    f, made, _ = _factory(slots_per_host=3)
    slots = [f.new_slot() for _ in range(7)]
    assert len(made) == 3 and f.stats()["hosts"] == 3
    assert [(made.index(s.host.handle), s.index) for s in slots] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
    ]
    assert all(h.name.startswith("coordinator-") for h in made)


def test_a_hosts_ready_is_paid_once_for_all_its_slots():
    f, made, _ = _factory(slots_per_host=4, delay=0.05)

    async def main():
        slots = [f.new_slot() for _ in range(4)]
        await asyncio.gather(*(f.ready(s) for s in slots))

    asyncio.run(main())
    assert [c[0] for c in made[0].calls] == ["ready"]


def test_a_dead_host_is_ended_and_gets_no_more_slots():
    f, made, killed = _factory(slots_per_host=3)
    a = f.new_slot()
    made[0].dead = True
    f.discard(a, dead=True)
    assert killed == [made[0]] and f.stats()["hosts_lost"] == 1
    b = f.new_slot()
    assert b.host.handle is made[1] and b.index == 0  # never slot 1 of the dead host

    f2, made2, killed2 = _factory(slots_per_host=2)
    s = f2.new_slot()
    made2[0].dead = True

    async def ready_fails():
        with pytest.raises(RuntimeError, match="died"):
            await f2.ready(s)

    asyncio.run(ready_fails())
    assert killed2 == [made2[0]] and f2.new_slot().host.handle is made2[1]


def test_a_host_whose_slots_were_all_dropped_is_ended():
    f, made, killed = _factory(slots_per_host=2)
    a, b = f.new_slot(), f.new_slot()
    f.discard(a, dead=False)
    assert killed == []  # one slot still lives
    f.discard(b, dead=False)
    assert killed == [made[0]]


def test_the_pool_keeps_headroom_so_a_burst_never_waits_for_a_start():
    """size 4, headroom 4, 3 slots per host, each host start taking 0.2 s: after each lease the
    pool tops up in the background, so requests arriving one by one find a free slot at once."""
    f, made, _ = _factory(slots_per_host=3, delay=0.2)

    async def main():
        pool = CoordinatorPool(f.new_slot, f.ready, size=4, max_size=12, headroom=4, probe=f.ping, on_discard=f.discard)
        await pool.start()
        held = []
        for _ in range(8):
            held.append(await pool.acquire())
            await asyncio.sleep(0.3)  # room for a background start
        assert pool.stats.waits == 0  # nobody waited for a coordinator
        assert pool.stats.idle >= 3 and pool.stats.size <= 12
        for h in held:
            pool.release(h)
        await pool.shutdown()

    asyncio.run(main())
    assert len(made) >= 4  # hosts were started ahead of the leases that used them


def test_without_headroom_a_lease_past_the_idle_ones_starts_a_slot_itself():
    f, made, _ = _factory(slots_per_host=3)

    async def main():
        pool = CoordinatorPool(f.new_slot, f.ready, size=1, max_size=4, probe=f.ping, on_discard=f.discard)
        await pool.start()
        a, b = await pool.acquire(), await pool.acquire()
        assert pool.stats.size == 2 and pool.stats.idle == 0 and a.host is b.host
        pool.release(a)
        pool.release(b)
        await pool.shutdown()

    asyncio.run(main())
    assert len(made) == 1


def test_a_coordinator_host_process_does_not_load_torch():
    """What makes a host light: the coordinators' code imports neither torch nor transformers
    (tokenizing uses the generator's pickled tokenizer through ralm.tokens)."""
    import subprocess
    import sys

    code = (
        "import sys, actors.coordinator, actors.pool; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ a slot handed over while its request ends
class _Request:
    """What ``CoordinatorHost`` keeps of a running request (``cancelled``: one still ending)."""

    def __init__(self, session: str, cancelled: bool = False):
        import threading
        from types import SimpleNamespace

        self.session, self.resumed, self.kb_cache = session, False, None
        self.cancelled = threading.Event()
        if cancelled:
            self.cancelled.set()
        self.gen = SimpleNamespace(calls=0)


def _host_with_slot_0_busy(monkeypatch):
    import actors.coordinator as coordinator

    monkeypatch.setattr(coordinator, "Coordinator", lambda shared, session: _Request(session))
    host = coordinator.CoordinatorHost(generator=None, verifiers={}, slots=2)
    old = _Request("old:0:0", cancelled=True)
    host._running[0] = old
    return host, old


def test_a_slot_leased_while_its_last_request_ends_waits_for_it_instead_of_failing(monkeypatch):
    """The pool may lease a slot again while the host is still ending the slot's cancelled
    request: the new request waits for that end, then runs (it used to fail with HTTP 500)."""
    import threading

    host, old = _host_with_slot_0_busy(monkeypatch)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("coord", host._start(0)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and "coord" not in got  # still waiting: the old request has not ended
    host._finish(0, old)
    t.join(5)
    assert got["coord"].session.endswith(":0:0") and host._running[0] is got["coord"]
    assert host.handoff_waits == 1 and host.info()["handoff_waits"] == 1
    host._finish(0, old)  # a late finish of the old request never frees the new one's slot
    assert host._running[0] is got["coord"]


def test_a_slot_whose_request_never_ends_fails_the_new_request_with_a_clear_error(monkeypatch):
    import actors.coordinator as coordinator

    host, _ = _host_with_slot_0_busy(monkeypatch)
    monkeypatch.setattr(coordinator.C, "COORDINATOR_SLOT_HANDOFF_S", 0.1)
    with pytest.raises(RuntimeError, match=r"slot 0 still runs request old:0:0 after 0.1 s"):
        host._start(0)
    assert host._start(1).session.endswith(":1:0")  # other slots are unaffected


def test_a_request_cancelled_while_its_slot_starts_drops_the_slot_without_killing_the_host():
    """A request that goes away while a new slot of a live host gets ready must not end the
    host: its other slots may be running requests."""
    f, made, killed = _factory(slots_per_host=3)

    async def ready(slot):  # the host is up; its second slot takes a while to be ready
        await f.ready(slot)
        if slot.index > 0:
            await asyncio.sleep(0.5)

    pool = CoordinatorPool(f.new_slot, ready, size=1, max_size=4, on_discard=f.discard, probe=f.ping)

    async def main():
        await pool.start()
        busy = await pool.acquire()  # the only idle slot, now running a request
        waiter = asyncio.ensure_future(pool.acquire())  # starts slot 1 of the same host
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return busy

    busy = asyncio.run(main())
    assert killed == [] and not busy.host.dead and f.stats()["hosts_lost"] == 0
