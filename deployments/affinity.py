"""Session affinity on a generator replica: request session keys as Serve multiplexed ids.

A coordinator gives each request a session key and sends every step of it with
``handle.options(multiplexed_model_id=key)``. Serve routes a multiplexed id to the replica
that has "loaded" it, so the request's steps keep landing on the replica that holds its KV
sessions (:mod:`ralm.batching.sessions`). Loading a key here only records it
(:class:`SessionKeys`): the loader returns a :class:`SessionLease`, Serve keeps it in its
per-replica LRU of multiplexed ids (``max_num_models_per_replica``) and calls its
``__del__`` when it evicts the key, which releases the key's sessions. A request that ends
releases its key explicitly (:meth:`SessionKeys.release`, the deployment's ``release``).

Serve's routers learn which replica loaded a key from the controller, a fraction of a
second after the load; a request's next steps can be faster than that and, routed to a
replica with the fewest keys, load the key there too, after which its steps go to either.
:class:`SessionAffinityRouter` (the generator deployment's request router) closes that
window: it is Serve's default router that also remembers, locally, the replica it sent each
key to, and sends the key's later calls (steps and the release) there while that replica is
alive and accepts them within ``patience_s``.

Routing is a preference, never a requirement: a step that reaches another replica (the
first step of a request before Serve's routers have heard of its key, a replica that died,
a key evicted early) finds no session there and recomputes it, with the same tokens.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# Serve's default router (DEFAULT_REQUEST_ROUTER_PATH); ray.serve.request_router exports its parts only
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter as _DefaultRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

RECENT_KEYS = 64  # keys whose per-key record info() reports


@dataclass
class KeyRecord:
    """What one replica saw of one session key."""

    steps: int = 0  # steps served with this key
    loads: int = 0  # times Serve loaded the key here (1 unless it was evicted and came back)
    released: int | None = None  # sessions freed when the key was released; None while it is open
    evicted: bool = False  # released because Serve evicted the key from its LRU


class SessionLease:
    """A session key loaded on this replica: the object Serve's multiplexed LRU holds for it.
    Serve calls ``__del__`` when it evicts the key (and Python may call it again later): the
    first call releases the key's sessions, later ones do nothing."""

    def __init__(self, keys: SessionKeys, key: str):
        self.keys = keys
        self.key = key
        self.closed = False

    def __del__(self) -> None:
        if not self.closed:
            self.closed = True
            self.keys.release(self.key, evicted=True)


class SessionKeys:
    """The session keys of one replica and the release of their KV sessions.

    ``release_fn(key)`` frees the key's sessions and returns how many it freed
    (:meth:`ralm.engine.LMEngine.release`); ``held_fn(key)``: how many it holds now
    (:meth:`ralm.batching.sessions.SessionStore.held`). ``max_keys`` bounds Serve's
    multiplexed LRU.
    """

    def __init__(self, release_fn: Callable[[str], int], held_fn: Callable[[str], int], max_keys: int):
        from ray import serve

        self.release_fn = release_fn
        self.held_fn = held_fn
        self.max_keys = int(max_keys)
        self._lock = threading.Lock()
        self._records: OrderedDict[str, KeyRecord] = OrderedDict()
        self._leases: dict[str, SessionLease] = {}  # the open lease of each key Serve holds
        self.loaded = 0
        self.released = 0
        self.evicted = 0
        self.sessions_released = 0

        async def load_session_key(key: str) -> SessionLease:
            return self._loaded(key)

        # built per instance so that the bound comes from the config; Serve finds the
        # multiplexed function among the replica's attributes and creates its LRU on first use
        self.load: Callable[[str], Awaitable[Any]] = serve.multiplexed(max_num_models_per_replica=self.max_keys)(
            load_session_key
        )

    @staticmethod
    def current() -> str:
        """The session key of the Serve request being handled ("" outside Serve or without one)."""
        from ray import serve

        return serve.get_multiplexed_model_id()

    def _record(self, key: str) -> KeyRecord:
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = KeyRecord()
            while len(self._records) > self.max_keys + RECENT_KEYS:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(key)
        return rec

    def _loaded(self, key: str) -> SessionLease:
        with self._lock:
            rec = self._record(key)
            rec.loads += 1
            rec.released, rec.evicted = None, False
            self.loaded += 1
            lease = self._leases[key] = SessionLease(self, key)
        return lease

    async def step_owner(self) -> str | None:
        """The owner to tag this step's sessions with: the request's session key, loaded
        (recorded, made most recently used) in Serve's LRU; None when the step has no key."""
        key = self.current()
        if not key:
            return None
        await self.load(key)
        with self._lock:
            self._record(key).steps += 1
        return key

    def release(self, key: str, evicted: bool = False) -> int:
        """Free the key's KV sessions (the request ended, or Serve evicted the key); returns
        how many were freed. Never raises for an unknown or already released key."""
        freed = int(self.release_fn(key))
        with self._lock:
            lease = self._leases.pop(key, None)
            if lease is not None:
                lease.closed = True  # its eviction later has nothing left to release
            rec = self._record(key)
            first = rec.released is None
            rec.released = (rec.released or 0) + freed
            rec.evicted = rec.evicted or evicted
            self.released += int(first and not evicted)
            self.evicted += int(evicted)
            self.sessions_released += freed
        return freed

    def info(self) -> dict:
        """Counters, and the records of the most recently used keys with the number of
        sessions each holds now (``held``)."""
        with self._lock:
            recent = [(k, dict(r.__dict__)) for k, r in list(self._records.items())[-RECENT_KEYS:]]
            out: dict[str, Any] = {
                "max_keys": self.max_keys,
                "loaded": self.loaded,
                "released": self.released,
                "evicted": self.evicted,
                "sessions_released": self.sessions_released,
            }
        out["recent"] = {k: {**r, "held": self.held_fn(k)} for k, r in recent}
        return out


class SessionAffinityRouter(_DefaultRouter):
    """Serve's power-of-two-choices router with sticky session keys: the first call with a
    multiplexed model id goes where Serve's routing sends it, later ones to the same replica
    (remembered here, so without waiting for the controller's broadcast). A call that the
    pinned replica has not accepted within ``patience_s``, or whose replica is gone, is routed
    afresh and the key pinned to its new replica. Calls without a key are routed as usual."""

    def initialize_state(self, max_keys: int = 65536, patience_s: float = 1.0, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._pins: OrderedDict[str, ReplicaID] = OrderedDict()
        self._max_pins = int(max_keys)
        self._patience_s = float(patience_s)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is None or not key:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pinned = self._pins.get(key)
        replicas = {r.replica_id: r for r in candidate_replicas}
        if pinned in replicas and time.time() - pending_request.created_at < self._patience_s:
            self._pins.move_to_end(key)
            return [[replicas[pinned]]]
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        if not ranks or not ranks[0]:
            return ranks
        pick = ranks[0][0]
        self._pins[key] = pick.replica_id
        self._pins.move_to_end(key)
        while len(self._pins) > self._max_pins:
            self._pins.popitem(last=False)
        return [[pick]]
