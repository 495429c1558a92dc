"""A pool of pre-started coordinator actors (creating an actor costs ~0.45 s here).

The ingress runs each request on a coordinator of the pool (:meth:`CoordinatorPool.run`, or
:meth:`~CoordinatorPool.acquire` / :meth:`~CoordinatorPool.release` for a stream); the coordinator has already cleared its local cache by then.
The pool starts ``size`` coordinators up front and grows up to ``max_size`` under load;
beyond that, up to ``max_waiting`` requests wait for a free coordinator (first come, first
served) and any further one is refused at once with :class:`~ralm.errors.Overloaded`
(HTTP 503 with ``Retry-After``), so the queue is bounded. A coordinator that died is
replaced, and the request is retried once on a fresh one (requests are deterministic, so a
retry returns the same tokens). A request whose caller is cancelled (client gone, deadline
passed) is told to stop (``cancel(coordinator)``) and its coordinator comes back to the
pool only once it has stopped, so the next request never queues behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ralm.errors import Overloaded

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    size: int = 0  # coordinators alive
    idle: int = 0
    created: int = 0
    replaced: int = 0
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
    """Async pool of actor handles made by ``factory()`` and readied by ``ready(handle)``."""

    factory: Callable[[], Any]
    ready: Callable[[Any], Awaitable[Any]]
    size: int = 4
    max_size: int = 16
    max_waiting: int = 64
    _idle: asyncio.Queue[Any] = field(init=False, repr=False)  # made in __post_init__
    _all: list = field(default_factory=list, init=False, repr=False)
    _creating: int = field(default=0, init=False, repr=False)
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

    def _new(self) -> Any:
        h = self.factory()
        self._all.append(h)
        self.stats.created += 1
        return h

    def _sync_stats(self) -> None:
        self.stats.size = len(self._all)
        self.stats.idle = self._idle.qsize()

    async def acquire(self) -> Any:
        self.stats.leases += 1
        try:
            h = self._idle.get_nowait()
        except asyncio.QueueEmpty:
            h = None
        if h is None and len(self._all) + self._creating < self.max_size:
            self._creating += 1
            try:
                h = self._new()
                await self.ready(h)
            except BaseException:
                self._discard(h)
                raise
            finally:
                self._creating -= 1
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
        return h

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

    def _discard(self, handle: Any) -> None:
        if handle in self._all:
            self._all.remove(handle)
        try:
            import ray

            ray.kill(handle)
        except Exception:  # already dead, or not an actor
            pass

    async def replace(self, handle: Any) -> None:
        """Drop a dead coordinator and start a new one in its place (if below ``size``)."""
        self._discard(handle)
        self.stats.replaced += 1
        if len(self._all) < self.size:
            h = self._new()
            await self.ready(h)
            self._idle.put_nowait(h)
        self._sync_stats()

    async def run(
        self,
        fn: Callable[[Any], Awaitable[Any]],
        retries: int = 1,
        cancel: Callable[[Any], Any] | None = None,
    ) -> Any:
        """``await fn(coordinator)`` on a leased coordinator, retried on a fresh one if it died.

        If the caller is cancelled while the work runs, ``cancel(coordinator)`` asks it to
        stop, and the coordinator returns to the pool (or is replaced) once the work is over."""
        for attempt in range(retries + 1):
            h = await self.acquire()
            t0 = time.perf_counter()
            work = asyncio.ensure_future(fn(h))
            try:
                res = await asyncio.shield(work)
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                if cancel is not None:
                    with contextlib.suppress(Exception):
                        cancel(h)
                work.add_done_callback(functools.partial(self._settle, h))
                raise
            except BaseException as e:
                self._note_lease(time.perf_counter() - t0)
                if self._give_back(h, e) and attempt < retries:
                    continue
                raise
            self._note_lease(time.perf_counter() - t0)
            self.release(h)
            return res
        raise AssertionError("unreachable")  # pragma: no cover

    def _give_back(self, handle: Any, error: BaseException | None) -> bool:
        """Return a coordinator after its work, or replace it if the work found it dead (True)."""
        if error is not None and _is_actor_death(error):
            log.warning("coordinator died during a request; replacing it")
            asyncio.ensure_future(self.replace(handle))
            return True
        self.release(handle)
        return False

    def _settle(self, handle: Any, work: asyncio.Future) -> None:
        """The work of a cancelled request is over: give its coordinator back (or replace it)."""
        self._give_back(handle, None if work.cancelled() else work.exception())

    async def shutdown(self) -> None:
        for h in list(self._all):
            self._discard(h)
        self._sync_stats()


def _is_actor_death(e: BaseException) -> bool:
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))
