"""Slots of coordinator hosts: what the coordinator pool leases.

A :class:`~actors.coordinator.CoordinatorHost` actor runs up to ``slots_per_host`` requests
at once, each on its own coordinator. The pool (:class:`~actors.pool.CoordinatorPool`) deals
in :class:`CoordinatorSlot` handles, one request at a time each, made by a
:class:`SlotFactory`: a new slot is the next unused slot of the newest live host, and a new
host (a new process) is started only when every host is full. Starting a slot on a running
host costs nothing, so the pool can keep free slots ahead of demand.

Worked example, ``slots_per_host=64``: a pool of ``size=32`` starts one host and hands out
its slots 0..31; growing to 64 slots uses slots 32..63 of the same host; the 65th slot
starts a second host. 256 requests in flight are four processes, not 256.

Faults: when the pool finds a slot dead (its host died, or stopped answering pings), the
whole host is dead: :meth:`SlotFactory.discard` kills it (its other requests fail over to
fresh slots and resume from their checkpoints) and no slot is made on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ralm import constants as C

log = logging.getLogger(__name__)


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


__all__ = ["CoordinatorSlot", "HostRecord", "SlotFactory"]
