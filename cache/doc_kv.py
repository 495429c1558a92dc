"""Doc-KV cache: the key/value tensors of a document prefix, reused across steps and requests.

Exact by construction: a document's KV is always computed from the document tokens
alone (the document is the prompt's prefix), so a hit returns bit-identical tensors
to a recomputation. Keyed by the document's token ids, bounded in bytes (LRU).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable


@dataclass
class DocKVStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    entries: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DocKVCache:
    """LRU map key -> value bounded by the sum of ``size_of(value)`` bytes.

    ``capacity_bytes=0`` disables caching (every ``get_or_compute`` computes).
    Thread-safe: the serving path may call it from several threads.
    """

    def __init__(self, capacity_bytes: int, size_of: Callable[[Any], int]):
        self.capacity_bytes = int(capacity_bytes)
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = DocKVStats()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: Hashable, value: Any) -> None:
        size = int(self._size_of(value))
        if size > self.capacity_bytes:
            return
        with self._lock:
            if key in self._items:
                self.stats.bytes_used -= self._items.pop(key)[1]
            self._items[key] = (value, size)
            self.stats.bytes_used += size
            while self.stats.bytes_used > self.capacity_bytes:
                _, (_, sz) = self._items.popitem(last=False)
                self.stats.bytes_used -= sz
                self.stats.evictions += 1
            self.stats.entries = len(self._items)

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> tuple[Any, bool]:
        """(value, hit). Computes and stores on a miss."""
        value = self.get(key)
        if value is not None:
            return value, True
        value = compute()
        self.put(key, value)
        return value, False

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.stats.bytes_used = 0
            self.stats.entries = 0
