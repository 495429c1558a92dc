"""Leases of coordinators: the pool and the slots it leases, in one place.

A request runs on a *coordinator*: one slot of a coordinator host actor
(:class:`~actors.coordinator.CoordinatorHost`, which runs up to ``slots_per_host`` requests
at once, each on its own coordinator). This module is everything about getting one, holding
it and giving it back:

- :class:`CoordinatorPool` leases coordinators to requests: :meth:`~CoordinatorPool.run` for
  one answer, :meth:`~CoordinatorPool.stream` for a stream (the lease lasts until the stream
  is read to its end or, when the client goes away, until the coordinator has stopped);
- :class:`SlotFactory` makes the pool's coordinators, :class:`CoordinatorSlot` handles: a
  new slot is the next unused slot of the newest live host, and a new host (a new process)
  is started only when every host is full. Starting a slot on a running host costs nothing,
  so the pool can keep free slots ahead of demand.

The pool (a coordinator has cleared its local cache before it is leased again):

- The pool starts ``size`` coordinators up front and grows up to ``max_size`` under load,
  ahead of demand: whenever a lease leaves fewer than ``headroom`` coordinators idle or
  starting, more are started in the background, so a burst finds them ready. Beyond that,
  up to ``max_waiting`` requests wait for a free coordinator (first come, first served) and any further one is refused at once with :class:`~ralm.errors.Overloaded`
  (HTTP 503 with ``Retry-After``), so the queue is bounded.
- A coordinator that died is replaced, and its request is retried on a fresh one (requests
  are deterministic and resume from their checkpoint, so a retry returns the same tokens).
- A coordinator whose node vanished may never answer at all: while a request runs, its
  coordinator is pinged every ``probe_interval_s``; a ping unanswered for ``probe_timeout_s``
  counts as a death. One death makes the pool ping its idle coordinators too (a node usually
  holds several), and replacements are started, with back-off, until the pool is back to
  ``size`` or to what the waiting requests need. A coordinator that cannot be started within
  ``ready_timeout_s`` (no node can take it) is given up; its request gets a retryable 503.
- A request whose caller is cancelled (client gone, deadline passed) is told to stop
  (``cancel(coordinator)``) and its coordinator comes back to the pool only once it has
  stopped, so the next request never queues behind it.

The slots, worked example, ``slots_per_host=64``: a pool of ``size=32`` starts one host and
hands out its slots 0..31; growing to 64 slots uses slots 32..63 of the same host; the 65th
slot starts a second host. 256 requests in flight are four processes, not 256. When the pool
finds a slot dead (its host died, or stopped answering pings), the whole host is dead:
:meth:`SlotFactory.discard` kills it (its other requests fail over to fresh slots and resume
from their checkpoints) and no slot is made on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ralm import constants as C
from ralm.errors import Overloaded

log = logging.getLogger(__name__)


class CoordinatorLost(Exception):
    """A leased coordinator stopped answering pings (its node is gone); treated as dead."""


@dataclass
class PoolStats:
    size: int = 0  # coordinators alive (or being started)
    idle: int = 0
    created: int = 0
    replaced: int = 0  # coordinators dropped because they died or stopped answering
    lost: int = 0  # of which found by a ping (unanswered or dead), not by a failed request
    start_failures: int = 0  # coordinators that could not be started (retried with back-off)
    leases: int = 0
    waits: int = 0  # leases that had to wait for a coordinator
    wait_s: float = 0.0
    waiting: int = 0  # requests waiting now
    rejected: int = 0  # refused because max_waiting requests were already waiting (503)
    cancelled: int = 0  # requests whose caller went away or timed out while they ran
    mean_lease_s: float = 0.0  # moving average of how long a request holds a coordinator

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CoordinatorPool:
    """Async pool of actor handles made by ``factory()`` and readied by ``ready(handle)``;
    ``probe(handle)``, if given, is a cheap call that a live coordinator answers at once."""

    factory: Callable[[], Any]
    ready: Callable[[Any], Awaitable[Any]]
    size: int = 4
    max_size: int = 16
    max_waiting: int = 64
    probe: Callable[[Any], Awaitable[Any]] | None = None
    on_discard: Callable[[Any, bool], None] | None = None  # (handle, found dead); default: ray.kill an actor
    headroom: int = 0  # keep this many coordinators idle or starting, ahead of demand (up to max_size)
    ready_timeout_s: float = C.COORDINATOR_READY_TIMEOUT_S
    probe_interval_s: float = C.COORDINATOR_PROBE_INTERVAL_S
    probe_timeout_s: float = C.COORDINATOR_PROBE_TIMEOUT_S
    _idle: asyncio.Queue[Any] = field(init=False, repr=False)  # made in __post_init__
    _all: list = field(default_factory=list, init=False, repr=False)
    _starting: int = field(default=0, init=False, repr=False)  # in _all, not ready yet
    _sweeping: bool = field(default=False, init=False, repr=False)
    _topping: bool = field(default=False, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    stats: PoolStats = field(default_factory=PoolStats, init=False)

    def __post_init__(self) -> None:
        if self.size < 1 or self.max_size < self.size:
            raise ValueError(f"pool size {self.size} / max_size {self.max_size}: need 1 <= size <= max_size")
        if self.max_waiting < 0:
            raise ValueError(f"pool max_waiting {self.max_waiting}: need >= 0")
        self._idle = asyncio.Queue()

    async def start(self) -> CoordinatorPool:
        """Create and ready ``size`` coordinators (concurrently)."""
        handles = [self._new() for _ in range(self.size)]
        await asyncio.gather(*(self.ready(h) for h in handles))
        for h in handles:
            self._idle.put_nowait(h)
        self._sync_stats()
        return self

    # ------------------------------------------------------------------ life cycle
    def _new(self) -> Any:
        h = self.factory()
        self._all.append(h)
        self.stats.created += 1
        return h

    async def _start_one(self, timeout_s: float | None = None) -> Any:
        """A new coordinator, ready within ``timeout_s`` (default ``ready_timeout_s``); on any
        failure it is dropped and the error raised."""
        h = self._new()
        self._starting += 1
        try:
            await asyncio.wait_for(self.ready(h), self.ready_timeout_s if timeout_s is None else timeout_s)
        except asyncio.CancelledError:
            # the request that wanted it went away: the coordinator is not dead (a slot's host
            # may run other requests), it is only dropped
            self._discard(h, dead=False)
            raise
        except BaseException:
            self._discard(h, dead=True)
            raise
        finally:
            self._starting -= 1
            self._sync_stats()
        return h

    def _short(self) -> bool:
        """Below ``size``, fewer coordinators starting than requests waiting, or fewer idle and
        starting than ``headroom`` (the last two up to ``max_size``)."""
        n = len(self._all)
        if n < self.size:
            return True
        if n >= self.max_size:
            return False
        return self.stats.waiting > self._starting or self._idle.qsize() + self._starting < self.headroom

    def _grow_ahead(self) -> None:
        """Start coordinators in the background when a lease left the pool short of headroom,
        so the next requests find one ready instead of waiting for a start."""
        if not self._topping and not self._closed and self._short():
            asyncio.ensure_future(self._top_up())

    async def _top_up(self) -> None:
        """Start coordinators while the pool is short of them, backing off when starts fail
        (e.g. no node can take one until a replacement node joins)."""
        if self._topping:
            return
        self._topping = True
        try:
            await self._top_up_loop()
        finally:
            self._topping = False

    async def _top_up_loop(self) -> None:
        delay = 0.5
        while not self._closed and self._short():
            try:
                h = await self._start_one()
            except Exception as e:
                self.stats.start_failures += 1
                log.warning("could not start a coordinator (%s: %s); retrying in %.1f s", type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)
                continue
            self._idle.put_nowait(h)
            self._sync_stats()

    def _sync_stats(self) -> None:
        self.stats.size = len(self._all)
        self.stats.idle = self._idle.qsize()

    def _discard(self, handle: Any, dead: bool = False) -> None:
        if handle in self._all:
            self._all.remove(handle)
        if self.on_discard is not None:
            self.on_discard(handle, dead)
            return
        ray = sys.modules.get("ray")  # not imported: the handle cannot be an actor
        # only a real actor handle, and only while Ray runs: ray.kill on anything else would
        # start a local Ray instance (its auto-init), blocking this event loop for seconds
        if ray is not None and ray.is_initialized() and isinstance(handle, ray.actor.ActorHandle):
            with contextlib.suppress(Exception):  # already dead
                ray.kill(handle)

    async def replace(self, handle: Any) -> None:
        """Drop a dead coordinator, check the idle ones (they may share its node) and start
        new ones until the pool is no longer short."""
        self._discard(handle, dead=True)
        self.stats.replaced += 1
        self._sync_stats()
        if not self._sweeping and self.probe is not None:
            asyncio.ensure_future(self._sweep_idle())
        await self._top_up()

    async def _alive(self, handle: Any) -> bool:
        assert self.probe is not None
        try:
            await asyncio.wait_for(self.probe(handle), self.probe_timeout_s)
        except asyncio.TimeoutError:
            return False
        except Exception as e:
            return not is_actor_death(e)
        return True

    async def _sweep_idle(self) -> None:
        """Ping every idle coordinator; drop those that are dead or do not answer."""
        self._sweeping = True
        try:
            handles = list(self._idle._queue)  # type: ignore[attr-defined]  # a snapshot; no await before it
            alive = await asyncio.gather(*(self._alive(h) for h in handles))
            dead = [h for h, ok in zip(handles, alive) if not ok]
            if not dead:
                return
            kept = []
            while not self._idle.empty():
                h = self._idle.get_nowait()
                if not any(h is d for d in dead):
                    kept.append(h)
            for h in kept:
                self._idle.put_nowait(h)
            for h in dead:
                self._discard(h, dead=True)
            self.stats.replaced += len(dead)
            self.stats.lost += len(dead)
            log.warning("%d idle coordinator(s) found dead; replacing them", len(dead))
            self._sync_stats()
        finally:
            self._sweeping = False
        await self._top_up()

    # ------------------------------------------------------------------ leases
    async def acquire(self) -> Any:
        self.stats.leases += 1
        h = None if self._idle.empty() else self._idle.get_nowait()
        if h is None and len(self._all) < self.max_size:
            h = await self._start_for_request()
        if h is None:
            if self.stats.waiting >= self.max_waiting:
                self.stats.rejected += 1
                raise Overloaded(
                    f"the server is at capacity ({len(self._all)} requests running, {self.stats.waiting} waiting); "
                    "retry later",
                    self.retry_after_s(),
                )
            self.stats.waits += 1
            self.stats.waiting += 1
            t0 = time.perf_counter()
            try:
                h = await self._idle.get()
            finally:
                self.stats.waiting -= 1
            self.stats.wait_s += time.perf_counter() - t0
        self._sync_stats()
        self._grow_ahead()
        return h

    async def _start_for_request(self) -> Any:
        """A new coordinator for a request. One that dies while starting (placed on a node
        that is going away, before Ray knows) is retried with back-off; after
        ``ready_timeout_s`` in all, the request gets a retryable :class:`Overloaded`."""
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.5
        while True:
            try:
                return await self._start_one(max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self._unavailable(f"no coordinator could be started within {self.ready_timeout_s:g} s") from None
            except Exception as e:
                if not is_actor_death(e):
                    raise
                self.stats.start_failures += 1
                if time.monotonic() + delay >= deadline:
                    raise self._unavailable(f"no coordinator could be started ({type(e).__name__})") from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    def _unavailable(self, why: str) -> Overloaded:
        log.warning("%s", why)
        return Overloaded(f"{why}; a node may have been lost, retry later", self.retry_after_s())

    def retry_after_s(self) -> float:
        """When a refused request may expect room: the queue ahead of it drained at the pool's
        pace (mean lease time × (waiting + 1) / coordinators), between 1 and 60 s."""
        per = self.stats.mean_lease_s or 1.0
        return min(60.0, max(1.0, per * (self.stats.waiting + 1) / max(1, len(self._all))))

    def _note_lease(self, seconds: float) -> None:
        m = self.stats.mean_lease_s
        self.stats.mean_lease_s = seconds if m == 0 else 0.9 * m + 0.1 * seconds

    def release(self, handle: Any) -> None:
        self._idle.put_nowait(handle)
        self._sync_stats()

    async def watch(self, handle: Any, work: asyncio.Future) -> Any:
        """``await work`` (a call on ``handle``), pinging ``handle`` every ``probe_interval_s``
        meanwhile; raises :class:`CoordinatorLost` (and cancels ``work``) if a ping fails.
        Cancelling the caller does not cancel ``work``."""
        if self.probe is None:
            return await asyncio.shield(work)
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.probe_interval_s)
            if done:
                return work.result()
            ping = asyncio.ensure_future(self._alive(handle))
            try:
                await asyncio.wait({work, ping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not ping.done():
                    ping.cancel()
            if work.done():
                return work.result()
            if not ping.result():
                work.cancel()
                self.stats.lost += 1
                raise CoordinatorLost(f"the coordinator did not answer a ping within {self.probe_timeout_s:g} s")

    async def run(
        self,
        fn: Callable[[Any], Awaitable[Any]],
        retries: int = C.COORDINATOR_DEATH_RETRIES,
        cancel: Callable[[Any], Any] | None = None,
    ) -> Any:
        """``await fn(coordinator)`` on a leased coordinator, retried on a fresh one (up to
        ``retries`` times) if it died; after that a retryable :class:`Overloaded`.

        If the caller is cancelled while the work runs, ``cancel(coordinator)`` asks it to
        stop, and the coordinator returns to the pool (or is replaced) once the work is over."""
        for attempt in range(retries + 1):
            h = await self.acquire()
            t0 = time.perf_counter()
            work = asyncio.ensure_future(fn(h))
            try:
                res = await self.watch(h, work)
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                if cancel is not None:
                    with contextlib.suppress(Exception):
                        cancel(h)
                work.add_done_callback(functools.partial(self._settle, h))
                raise
            except BaseException as e:
                self._note_lease(time.perf_counter() - t0)
                if self._give_back(h, e):
                    if attempt < retries:
                        continue
                    raise self._unavailable(f"the request's coordinator was lost {retries + 1} times") from e
                raise
            self._note_lease(time.perf_counter() - t0)
            self.release(h)
            return res
        raise AssertionError("unreachable")  # pragma: no cover

    async def stream(
        self,
        open_stream: Callable[[Any], AsyncIterator[Awaitable[Any]]],
        cancel: Callable[[Any], Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """A streamed request on a leased coordinator: ``open_stream(coordinator)`` gives the
        awaitables of its chunks (:meth:`CoordinatorSlot.run_stream`). Yields None once the
        coordinator is leased (the request is admitted), then every chunk, each awaited under
        the pool's liveness pings (a lost node never answers).

        A coordinator found dead is replaced and the stream fails with a retryable
        :class:`Overloaded` (a stream is not retried: its first chunks were sent). Closing the
        generator early (the client went away) or cancelling its reader asks the coordinator to
        stop (``cancel(coordinator)``); the coordinator comes back to the pool once its stream
        has ended, so the next request never queues behind it."""
        handle = await self.acquire()
        chunks = open_stream(handle)
        done = False
        pending: asyncio.Future | None = None  # the chunk being awaited (a drain takes it over)
        try:
            yield None
            while True:
                pending = asyncio.ensure_future(chunks.__anext__())
                try:
                    chunk = await self.watch(handle, pending)
                except StopAsyncIteration:
                    break
                pending = None
                yield await chunk
            done = True
            self.release(handle)
        except Exception as e:
            done = True
            if is_actor_death(e):
                asyncio.ensure_future(self.replace(handle))
                raise Overloaded(
                    "the coordinator running this stream was lost (a node may have been lost); retry the request",
                    self.retry_after_s(),
                ) from e
            self.release(handle)
            raise
        finally:
            if not done:  # the reader went away: stop the request, keep the lease until it has stopped
                if cancel is not None:
                    with contextlib.suppress(Exception):
                        cancel(handle)
                self.stats.cancelled += 1
                asyncio.ensure_future(self._drain(handle, chunks, pending))

    async def _drain(self, handle: Any, chunks: AsyncIterator[Awaitable[Any]], pending: asyncio.Future | None) -> None:
        """Read a cancelled stream to its end (the coordinator stops at its next step), then
        give the coordinator back; ``pending``: a chunk request already in flight."""
        try:
            if pending is not None:
                await (await pending)
            async for chunk in chunks:
                await chunk
        except Exception:  # its end (StopAsyncIteration), the cancellation error, a dead actor
            pass
        self.release(handle)

    def _give_back(self, handle: Any, error: BaseException | None) -> bool:
        """Return a coordinator after its work, or replace it if the work found it dead (True)."""
        if error is not None and is_actor_death(error):
            log.warning("coordinator died during a request (%s); replacing it", type(error).__name__)
            asyncio.ensure_future(self.replace(handle))
            return True
        self.release(handle)
        return False

    def _settle(self, handle: Any, work: asyncio.Future) -> None:
        """The work of a cancelled request is over: give its coordinator back (or replace it)."""
        self._give_back(handle, None if work.cancelled() else work.exception())

    async def shutdown(self) -> None:
        self._closed = True
        for h in list(self._all):
            self._discard(h)
        self._sync_stats()


def is_actor_death(e: BaseException) -> bool:
    if isinstance(e, CoordinatorLost):
        return True
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))


# ------------------------------------------------------------------ slots of coordinator hosts
@dataclass(eq=False)
class HostRecord:
    """One host actor and the bookkeeping of its slots."""

    handle: Any
    name: str
    capacity: int
    next_slot: int = 0  # slots 0..next_slot-1 were handed out
    live: int = 0  # handed-out slots not discarded
    dead: bool = False
    ready: asyncio.Future | None = None  # the host's ready() call, shared by its slots
    pinging: asyncio.Future | None = None  # the host's ping in flight, shared by its slots


@dataclass(eq=False)
class CoordinatorSlot:
    """One request at a time on slot ``index`` of a coordinator host (compared by identity)."""

    host: HostRecord
    index: int

    @property
    def name(self) -> str:
        return f"{self.host.name}[{self.index}]"

    def run(self, job: Any) -> Any:
        """ObjectRef of the job's result (``CoordinatorHost.run``)."""
        return self.host.handle.run.remote(self.index, job)

    def run_stream(self, job: Any) -> Any:
        """Streaming ObjectRefs of the job's chunks (``CoordinatorHost.run_stream``)."""
        return self.host.handle.run_stream.options(num_returns="streaming").remote(self.index, job)

    def cancel(self) -> Any:
        return self.host.handle.cancel.remote(self.index)

    def ping(self) -> Any:
        return self.host.handle.ping.remote()


@dataclass
class SlotFactory:
    """Makes slots for the pool, starting hosts as needed. ``make_host(name)`` starts a host
    actor named ``name`` (with ``slots_per_host`` slots) and returns its handle."""

    make_host: Callable[[str], Any]
    slots_per_host: int = C.POOL_SLOTS_PER_HOST
    kill: Callable[[Any], None] | None = None  # ends a host actor (default: ray.kill)
    hosts: list[HostRecord] = field(default_factory=list)
    started: int = 0  # hosts started in all
    lost: int = 0  # hosts found dead

    def __post_init__(self) -> None:
        if self.slots_per_host < 1:
            raise ValueError(f"slots_per_host {self.slots_per_host}: need >= 1")

    def new_slot(self) -> CoordinatorSlot:
        """The pool's ``factory``: the next unused slot of a live host, or of a new one."""
        host = next((h for h in reversed(self.hosts) if not h.dead and h.next_slot < h.capacity), None)
        if host is None:
            name = f"coordinator-{uuid.uuid4().hex[:12]}"
            host = HostRecord(self.make_host(name), name, self.slots_per_host)
            self.hosts.append(host)
            self.started += 1
        slot = CoordinatorSlot(host, host.next_slot)
        host.next_slot += 1
        host.live += 1
        return slot

    async def ready(self, slot: CoordinatorSlot) -> None:
        """The pool's ``ready``: the host's ``ready()`` (one call per host, shared by its slots).
        A host that fails it is dead."""
        host = slot.host
        if host.ready is None:
            host.ready = asyncio.ensure_future(host.handle.ready.remote())
        try:
            await asyncio.shield(host.ready)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._dead(host)
            raise

    async def ping(self, slot: CoordinatorSlot) -> None:
        """The pool's ``probe``: the host answers at once, even while all its slots are busy.
        Slots of one host pinged together share one call (a sweep pings every idle slot)."""
        host = slot.host
        if host.pinging is None or host.pinging.done():
            host.pinging = asyncio.ensure_future(slot.ping())
        await asyncio.shield(host.pinging)

    def discard(self, slot: CoordinatorSlot, dead: bool) -> None:
        """The pool dropped ``slot``; ``dead``: it was found dead, so its host is (killed now,
        never used again). A host whose every slot was handed out and dropped is ended."""
        host = slot.host
        host.live -= 1
        if dead:
            self._dead(host)
        elif host.live <= 0 and host.next_slot >= host.capacity:
            self._end(host)

    def _dead(self, host: HostRecord) -> None:
        if not host.dead:
            log.warning("coordinator host %s is dead or unreachable; its requests move to other slots", host.name)
            host.dead = True
            self.lost += 1
            self._end(host)

    def _end(self, host: HostRecord) -> None:
        if host in self.hosts:
            self.hosts.remove(host)
        kill = self.kill or _ray_kill
        with contextlib.suppress(Exception):  # already gone
            kill(host.handle)

    def shutdown(self) -> None:
        for host in list(self.hosts):
            self._end(host)

    def stats(self) -> dict:
        return {
            "hosts": len(self.hosts),
            "slots_per_host": self.slots_per_host,
            "hosts_started": self.started,
            "hosts_lost": self.lost,
        }


def _ray_kill(handle: Any) -> None:
    import ray  # lazy: the pool and its tests run without Ray

    ray.kill(handle)


__all__ = [
    "CoordinatorLost",
    "CoordinatorPool",
    "CoordinatorSlot",
    "HostRecord",
    "PoolStats",
    "SlotFactory",
    "is_actor_death",
]
