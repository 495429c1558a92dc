"""Serving through a state-store outage: checkpoints and the KB cache switch off, requests go on.

A request checkpoint and a cached KB answer are optimisations: a request is exact without
them. So while the store is down, a serving process should answer requests as if no store
were configured, not fail them, and not make each one wait out the store's retry budget.

:class:`DegradingStore` wraps the store a coordinator uses with a circuit breaker:

- **closed** (normal): every call goes to the store. A call that fails with
  :class:`~cache.state.base.StateStoreUnavailable` (the store's own short retries are
  spent) opens the breaker: one warning in the log, ``outages`` + 1.
- **open**: for ``cooldown_s`` seconds no call reaches the store. Reads answer "nothing
  there" (``load_checkpoint`` -> ``None``, ``get_kb_hits`` -> all misses), writes are
  skipped; each is counted in ``skipped`` (and reported through ``on_skip``, a metric).
- **half-open**: after the cool-down the next call tries the store again; success closes
  the breaker (an info line: the store is back), failure re-opens it.

Nothing recorded before the outage is lost (the store keeps it); what is skipped during
it is a checkpoint that would have been overwritten by the request's next one anyway, or a
KB answer that the KB itself computes. Eval jobs do not use this wrapper: their results
must be recorded, so they wait for the store instead (:mod:`cluster.eval_job`).

Example::

    store = DegradingStore(lambda: open_state_store(cfg), durable=True, cooldown_s=5.0)
    store.save_checkpoint(cp)      # skipped (counted) while Redis is down
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cache.state.base import StateStoreUnavailable

log = logging.getLogger(__name__)


class DegradingStore:
    """A :class:`~cache.state.base.StateStore` for serving paths (see the module docstring)."""

    def __init__(
        self,
        open_store: Callable[[], Any],
        durable: bool,
        cooldown_s: float = 5.0,
        on_skip: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``open_store``: makes the store; called on first use, and again after a failed
        open (a store that is down when serving starts is an outage like any other).
        ``durable``: whether that store survives a restart (checkpoints are kept only then)."""
        self._open_store = open_store
        self._store: Any = None
        self.durable = bool(durable)
        self.cooldown_s = float(cooldown_s)
        self.on_skip = on_skip
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # breaker open until this clock time
        self.outages = 0
        self.skipped = 0
        self.last_error = ""

    # ---------------------------------------------------------------- breaker
    @property
    def degraded(self) -> bool:
        """Whether the last call found the store unavailable (and it has not answered since)."""
        return self._open_until is not None

    def _skip(self, op: str) -> bool:
        """True when the breaker is open (the call is skipped and counted)."""
        with self._lock:
            if self._open_until is None or self._clock() >= self._open_until:
                return False  # closed, or half-open: try the store
            self.skipped += 1
        if self.on_skip is not None:
            self.on_skip(op)
        return True

    def _failed(self, op: str, e: Exception) -> None:
        with self._lock:
            first = self._open_until is None
            self._open_until = self._clock() + self.cooldown_s
            self.last_error = str(e)
            self.skipped += 1
            if first:
                self.outages += 1
        if first:
            log.warning(
                "state store unavailable (%s): serving without request checkpoints and the KB cache, "
                "retrying every %.0f s: %s",
                op,
                self.cooldown_s,
                e,
            )
        if self.on_skip is not None:
            self.on_skip(op)

    def _ok(self) -> None:
        if self._open_until is not None:
            with self._lock:
                was = self._open_until is not None
                self._open_until = None
            if was:
                log.info("state store is back: request checkpoints and the KB cache are on again")

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def connect(self) -> None:
        """Open the store now (a serving process's start-up); unreachable is an outage like any
        other, while a wrong password (:class:`~cache.state.base.StateStoreAuthError`) raises."""
        self._call("open", lambda: self.store, None)

    def _call(self, op: str, fn: Callable[[], Any], fallback: Any) -> Any:
        if self._skip(op):
            return fallback
        try:
            out = fn()
        except StateStoreUnavailable as e:
            self._failed(op, e)
            return fallback
        self._ok()
        return out

    # ---------------------------------------------------------------- serving operations
    def load_checkpoint(self, request_id: str):
        return self._call("load_checkpoint", lambda: self.store.load_checkpoint(request_id), None)

    def save_checkpoint(self, cp) -> None:
        self._call("save_checkpoint", lambda: self.store.save_checkpoint(cp), None)

    def delete_checkpoint(self, request_id: str) -> None:
        self._call("delete_checkpoint", lambda: self.store.delete_checkpoint(request_id), None)

    def get_kb_hits(self, keys: Sequence[Any]) -> list:
        keys = list(keys)
        return self._call("get_kb_hits", lambda: self.store.get_kb_hits(keys), [None] * len(keys))

    def put_kb_hits(self, items: Iterable[tuple[Any, Any]]) -> None:
        items = list(items)
        self._call("put_kb_hits", lambda: self.store.put_kb_hits(items), None)

    def stats(self) -> dict:
        return {
            "degraded": self.degraded,
            "outages": self.outages,
            "skipped": self.skipped,
            "last_error": self.last_error[:200],
        }

    def describe(self) -> str:
        if self._store is None:
            return "state store (not reached yet)"
        return str(self._store.describe())


__all__ = ["DegradingStore"]
