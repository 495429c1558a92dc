"""Doc-KV cache: the key/value tensors of a document prefix, reused across steps and requests.

Exact by construction: a document's KV is always computed from the document tokens
alone (the document is the prompt's prefix), so a hit returns bit-identical tensors
to a recomputation. Keyed by the document's token ids, bounded in bytes (LRU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DocKVStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    entries: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


DocSeq = tuple  # tuple of documents, each a tuple of token ids


class DocTreeStats(DocKVStats):
    """``hits``/``misses`` count documents (nodes) found / computed; ``bytes_reused`` is the
    KV volume served from the cache; ``prefix_hits`` counts lookups that reused a strict,
    non-empty prefix of a longer document sequence; ``shifted_reuses`` counts inexact
    position-shifted reuses (only with ``allow_inexact_shifted_reuse``)."""

    bytes_reused: int = 0
    lookups: int = 0
    full_hits: int = 0
    prefix_hits: int = 0
    shifted_reuses: int = 0


class DocPrefixTree:
    """Byte-bounded LRU prefix tree: document sequence ``(d1, ..., dj)`` -> the KV *segment*
    of ``dj`` computed on top of the KV of ``(d1, ..., dj-1)``.

    The KV of a prefix never depends on what follows it, so the KV of ``(d1..dn)`` is the
    concatenation of the segments along the path, bit-identical to computing the documents
    one after another (the engine's canonical computation: document by document). A lookup
    returns the segments of the longest cached prefix; the caller computes the rest on top
    and inserts them. Accessing a node refreshes it and then its ancestors, so an ancestor
    is always more recent than its descendants and the LRU victim is a leaf; an evicted
    node takes its (already older) subtree with it. ``capacity_bytes=0`` disables storage.
    Segments are lists of per-layer ``(key, value)`` tensors; ``size_of(segment)`` gives bytes.
    """

    def __init__(self, capacity_bytes: int, size_of: Callable[[Any], int]):
        self.capacity_bytes = int(capacity_bytes)
        self._size_of = size_of
        self._nodes: OrderedDict[DocSeq, tuple[Any, int]] = OrderedDict()
        self._children: dict[DocSeq, set] = {}
        self._lock = threading.Lock()
        self.stats = DocTreeStats()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, path: DocSeq) -> bool:
        return tuple(path) in self._nodes

    def _touch_path(self, path: DocSeq) -> None:
        for j in range(len(path), 0, -1):  # leaf first, root-most last (= most recent)
            p = path[:j]
            if p in self._nodes:
                self._nodes.move_to_end(p)

    def lookup(self, docs: DocSeq) -> list[Any]:
        """Segments of the longest cached prefix of ``docs`` (possibly empty), in order."""
        docs = tuple(docs)
        segs: list[Any] = []
        with self._lock:
            self.stats.lookups += 1
            for j in range(1, len(docs) + 1):
                item = self._nodes.get(docs[:j])
                if item is None:
                    break
                segs.append(item[0])
                self.stats.bytes_reused += item[1]
            n = len(segs)
            self._touch_path(docs[:n])
            self.stats.hits += n
            self.stats.misses += len(docs) - n
            if n == len(docs) and n:
                self.stats.full_hits += 1
            elif n:
                self.stats.prefix_hits += 1
        return segs

    def standalone(self, doc: tuple) -> Any | None:
        """The segment of ``doc`` computed alone (path ``(doc,)``), or None. Used only by the
        inexact position-shifted reuse."""
        with self._lock:
            item = self._nodes.get((tuple(doc),))
            if item is not None:
                self._nodes.move_to_end((tuple(doc),))
                self.stats.shifted_reuses += 1
                self.stats.bytes_reused += item[1]
            return None if item is None else item[0]

    def insert(self, docs: DocSeq, segment: Any) -> None:
        """Store the segment of ``docs[-1]`` on top of ``docs[:-1]`` (the parent must exist,
        unless ``docs`` has one element; otherwise nothing is stored)."""
        path = tuple(docs)
        size = int(self._size_of(segment))
        if not path or size > self.capacity_bytes:
            return
        with self._lock:
            parent = path[:-1]
            if parent and parent not in self._nodes:
                return
            if path in self._nodes:
                self.stats.bytes_used -= self._nodes.pop(path)[1]
            self._nodes[path] = (segment, size)
            self._children.setdefault(parent, set()).add(path)
            self.stats.bytes_used += size
            self._touch_path(path)
            while self.stats.bytes_used > self.capacity_bytes and self._nodes:
                victim = next(iter(self._nodes))
                self._evict(victim)
            self.stats.entries = len(self._nodes)

    def _evict(self, path: DocSeq) -> None:
        for child in list(self._children.pop(path, ())):
            if child in self._nodes:
                self._evict(child)
        item = self._nodes.pop(path, None)
        if item is not None:
            self.stats.bytes_used -= item[1]
            self.stats.evictions += 1
        sib = self._children.get(path[:-1])
        if sib is not None:
            sib.discard(path)

    def clear(self) -> None:
        with self._lock:
            self._nodes.clear()
            self._children.clear()
            self.stats.bytes_used = 0
            self.stats.entries = 0
