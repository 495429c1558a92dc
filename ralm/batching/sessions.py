"""KV sessions: each in-flight request's ``[docs][context so far]`` KV, kept between steps.

A step ``f(docs, context, k)`` needs the KV of ``[docs][context]``. The previous step of
the same request usually left most of it behind: the same documents and a context that
is a prefix of this one. A :class:`Session` is that leftover: the documents, the context
tokens whose KV it holds, and the KV itself (:class:`~ralm.batching.paged_kv.PagedKV`).

The store is *content-addressed*: a step takes the session with the same documents whose
context shares the longest prefix with its own, crops it to that prefix (a rollback simply
lands on a shorter common prefix) and computes only the rest. A step with other documents
finds no session and starts from the doc-KV cache. Because the forward is chunk-invariant,
the KV appended token by token, in chunks or in one prefill is the same bits, so a reused
session and a recomputed one give the same tokens: a lost or evicted session costs time,
never a token.

Sessions live under a byte budget (least recently used first out). A taken session is out
of the store until it is put back, so two concurrent steps never share one; each request
tags its sessions with an owner key so that :meth:`SessionStore.release` frees them when
the request ends or is cancelled.

A session's KV is a block table (:mod:`ralm.batching.kv_pool`): it counts the blocks only
it holds when it is stored (the documents' blocks it shares are the doc-block cache's; a
sequence in a pool of its own counts its whole pool), and a dropped session gives its
blocks back (outside the store's lock: the pool may be asking the store to drop one,
:meth:`SessionStore.evict_one`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ralm.batching.paged_kv import PagedKV

DocsKey = tuple  # tuple of documents, each a tuple of token ids


@dataclass
class Session:
    """KV of ``[docs][context]``: ``len(kv) == doc_len + len(context)``."""

    docs: DocsKey
    doc_len: int
    context: list[int]
    kv: PagedKV
    owner: str | None = None

    @property
    def nbytes(self) -> int:
        """What keeping the session costs: the blocks only it holds."""
        return self.kv.own_bytes()

    def drop(self) -> None:
        """Give the session's blocks back."""
        self.kv.free()


def _drop(sessions: Iterable[Session]) -> None:
    for s in sessions:
        s.drop()


@dataclass
class SessionStats:
    takes: int = 0  # steps that asked for a session
    hits: int = 0  # ... and found one with their documents
    reused_tokens: int = 0  # context tokens whose KV came from a session
    evictions: int = 0
    released: int = 0
    bytes_used: int = 0
    sessions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionStore:
    """Byte-bounded LRU of sessions; ``capacity_bytes=0`` keeps none (every step recomputes)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._items: OrderedDict[int, tuple[Session, int]] = OrderedDict()  # (session, bytes when stored)
        self._next = 0
        self._lock = threading.Lock()
        self.stats = SessionStats()

    def __len__(self) -> int:
        return len(self._items)

    def take(self, docs: DocsKey, context: list[int]) -> tuple[Session | None, int]:
        """The session for ``[docs][context]`` with the longest common context prefix (removed
        from the store), and that prefix's length; ``(None, 0)`` when none has these docs."""
        with self._lock:
            self.stats.takes += 1
            best, best_n = None, -1
            for key, (s, _) in self._items.items():
                if s.docs == docs:
                    n = common_prefix(s.context, context)
                    if n > best_n:
                        best, best_n = key, n
            if best is None:
                return None, 0
            sess, size = self._items.pop(best)
            self.stats.hits += 1
            self.stats.bytes_used -= size
            self.stats.sessions = len(self._items)
            return sess, best_n

    def put(self, sess: Session) -> None:
        """Store (or give back) a session; evicts the least recently used over budget."""
        size = sess.nbytes
        if size > self.capacity_bytes:
            sess.drop()
            return
        dropped = []
        with self._lock:
            self._items[self._next] = (sess, size)
            self._next += 1
            self.stats.bytes_used += size
            while self.stats.bytes_used > self.capacity_bytes and self._items:
                dropped.append(self._pop_oldest())
            self.stats.sessions = len(self._items)
        _drop(dropped)

    def _pop_oldest(self) -> Session:
        """Remove the least recently used session (the caller holds the lock and drops it)."""
        _, (old, size) = self._items.popitem(last=False)
        self.stats.bytes_used -= size
        self.stats.evictions += 1
        return old

    def evict_one(self) -> bool:
        """Drop the least recently used session (the pool needs blocks); False: none stored,
        or the store is busy (the pool calls this holding its own lock: it never waits here)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._items:
                return False
            old = self._pop_oldest()
            self.stats.sessions = len(self._items)
        finally:
            self._lock.release()
        old.drop()
        return True

    def release(self, owner: str) -> int:
        """Free every stored session of ``owner`` (a request that ended); returns how many."""
        with self._lock:
            keys = [k for k, (s, _) in self._items.items() if s.owner == owner]
            dropped = []
            for k in keys:
                sess, size = self._items.pop(k)
                self.stats.bytes_used -= size
                dropped.append(sess)
            self.stats.released += len(keys)
            self.stats.sessions = len(self._items)
        _drop(dropped)
        return len(keys)

    def held(self, owner: str) -> int:
        """How many stored sessions ``owner`` has."""
        with self._lock:
            return sum(1 for s, _ in self._items.values() if s.owner == owner)

    def clear(self) -> None:
        with self._lock:
            dropped = [s for s, _ in self._items.values()]
            self._items.clear()
            self.stats.bytes_used = 0
            self.stats.sessions = 0
        _drop(dropped)
