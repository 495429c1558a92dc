"""The documents' KV in the pool: one copy per document sequence, shared by every request on it.

The batched engine starts a step that has no KV session from its documents' KV. With the
KV pool (:mod:`ralm.batching.kv_pool`) that KV is a :class:`~ralm.batching.paged_kv.PagedKV`
kept here, keyed by the document sequence (a tuple of token tuples), and a step *forks* it:
the step's sequence references the same blocks (the partly filled last one is copied on
its first write). So 64 requests on one document hold its KV once, plus one block each.

Entries live under a byte budget, least recently used first out; a dropped entry gives its
references back, and blocks still used by a sequence stay until that sequence lets go.
Like the doc-KV prefix tree of the one-step-at-a-time path (:mod:`ralm.doc_kv`), entries
are document *prefixes*: ``(d1, d2)`` is kept next to ``(d1,)``, sharing its blocks, so a
step on ``(d1, d3)`` forks ``(d1,)`` and computes only ``d3`` (:meth:`fork_longest`). An
entry is charged for the blocks its prefix does not hold (the prefix's partly filled last
block included: its first write copies it). With the pool on, this cache is the only holder
of a document's KV: the batched engine computes a miss straight into the pool
(:meth:`~ralm.batching.engine.BatchEngine.start`), never through the prefix tree.
A miss is computed again, never guessed: the same bits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cache.doc_kv import DocKVStats
from ralm.batching.paged_kv import PagedKV

DocsKey = tuple


class DocBlockCache:
    """Byte-bounded LRU of document sequences' pooled KV; ``capacity_bytes=0`` keeps none."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._items: OrderedDict[DocsKey, tuple[PagedKV, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = DocKVStats()  # hits and misses count document sequences

    def __len__(self) -> int:
        return len(self._items)

    def fork(self, docs: DocsKey) -> PagedKV | None:
        """A new sequence sharing the cached KV of ``docs`` (None on a miss)."""
        with self._lock:
            item = self._items.get(docs)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(docs)
            self.stats.hits += 1
            return item[0].fork()

    def fork_longest(self, docs: DocsKey) -> tuple[PagedKV | None, int]:
        """A new sequence sharing the cached KV of the longest cached prefix of ``docs`` and
        how many documents it covers (``(None, 0)``: none cached). A whole-sequence hit counts
        as a hit, anything else as a miss."""
        with self._lock:
            for n in range(len(docs), 0, -1):
                item = self._items.get(docs[:n])
                if item is not None:
                    self._items.move_to_end(docs[:n])
                    if n == len(docs):
                        self.stats.hits += 1
                    else:
                        self.stats.misses += 1
                    return item[0].fork(), n
            self.stats.misses += 1
            return None, 0

    def put(self, docs: DocsKey, kv: PagedKV, size: int | None = None) -> None:
        """Keep ``kv`` (the cache takes this reference; pass a fork to keep using the sequence),
        charged ``size`` bytes (None: every block it references)."""
        size = kv.nbytes if size is None else int(size)
        dropped: list[PagedKV] = []
        with self._lock:
            if size > self.capacity_bytes or docs in self._items:
                dropped.append(kv)
            else:
                self._items[docs] = (kv, size)
                self.stats.bytes_used += size
                while self.stats.bytes_used > self.capacity_bytes and self._items:
                    dropped.append(self._pop_oldest())
            self.stats.entries = len(self._items)
        for d in dropped:
            d.free()

    def _pop_oldest(self) -> PagedKV:
        _, (old, size) = self._items.popitem(last=False)
        self.stats.bytes_used -= size
        self.stats.evictions += 1
        return old

    def evict_one(self) -> bool:
        """Drop the least recently used entry (the pool needs blocks); False: none cached, or
        the cache is busy. The pool calls this holding its own lock, and :meth:`fork` takes
        the pool's lock inside this cache's: so this never waits for the cache's lock (a busy
        cache frees nothing this time and the pool grows instead of deadlocking)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._items:
                return False
            old = self._pop_oldest()
            self.stats.entries = len(self._items)
        finally:
            self._lock.release()
        old.free()
        return True

    def clear(self) -> None:
        with self._lock:
            dropped = [kv for kv, _ in self._items.values()]
            self._items.clear()
            self.stats.bytes_used = 0
            self.stats.entries = 0
        for d in dropped:
            d.free()
