"""A pool of pre-started coordinator actors (creating an actor costs ~0.45 s here).

The ingress takes a coordinator for each request (:meth:`CoordinatorPool.lease`), and
gives it back afterwards; the coordinator has already cleared its local cache by then.
The pool starts ``size`` coordinators up front and grows up to ``max_size`` under load;
beyond that, requests wait for a free coordinator (first come, first served). A
coordinator that died is replaced, and the request is retried once on a fresh one
(requests are deterministic, so a retry returns the same tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CoordinatorPool:
    """Async pool of actor handles made by ``factory()`` and readied by ``ready(handle)``."""

    factory: Callable[[], Any]
    ready: Callable[[Any], Awaitable[Any]]
    size: int = 4
    max_size: int = 16
    _idle: asyncio.Queue[Any] = field(init=False, repr=False)  # made in __post_init__
    _all: list = field(default_factory=list, init=False, repr=False)
    _creating: int = field(default=0, init=False, repr=False)
    stats: PoolStats = field(default_factory=PoolStats, init=False)

    def __post_init__(self) -> None:
        if self.size < 1 or self.max_size < self.size:
            raise ValueError(f"pool size {self.size} / max_size {self.max_size}: need 1 <= size <= max_size")
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
            self.stats.waits += 1
            t0 = time.perf_counter()
            h = await self._idle.get()
            self.stats.wait_s += time.perf_counter() - t0
        self._sync_stats()
        return h

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

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Any]:
        """``async with pool.lease() as coordinator: ...``; a dead coordinator is replaced."""
        h = await self.acquire()
        try:
            yield h
        except BaseException as e:
            if _is_actor_death(e):
                log.warning("coordinator died during a request; replacing it")
                asyncio.ensure_future(self.replace(h))
            else:
                self.release(h)
            raise
        else:
            self.release(h)

    async def run(self, fn: Callable[[Any], Awaitable[Any]], retries: int = 1) -> Any:
        """``await fn(coordinator)`` on a leased coordinator, retried on a fresh one if it died."""
        for attempt in range(retries + 1):
            try:
                async with self.lease() as h:
                    return await fn(h)
            except BaseException as e:
                if attempt < retries and _is_actor_death(e):
                    continue
                raise

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
