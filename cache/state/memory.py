"""In-process state store: the embedded default. Thread-safe; lost when the process exits.

Values are stored as JSON strings, exactly as the durable stores keep them, so the
behaviour (what round-trips, what is rejected) is the same everywhere.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal, overload

from cache.state.base import Hit, KBKey, RequestCheckpoint, StateStore, dump_json, hits_from_json, hits_to_json
from cache.state.config import StateStoreConfig


class _Expiring:
    """Value with an optional absolute expiry time."""

    __slots__ = ("value", "expires_at")

    def __init__(self, value, ttl: int | None):
        self.value = value
        self.expires_at = time.time() + ttl if ttl else None

    def alive(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


class MemoryStateStore(StateStore):
    def __init__(self, cfg: StateStoreConfig | None = None):
        super().__init__(cfg or StateStoreConfig())
        self._lock = threading.RLock()
        self._jobs: dict[str, _Expiring] = {}  # job id -> {"meta": str, "items": {key: str}}
        self._ckpt: dict[str, _Expiring] = {}  # request id -> JSON
        self._kb: OrderedDict[str, _Expiring] = OrderedDict()  # digest -> JSON hits (LRU)

    @property
    def durable(self) -> bool:
        return False

    def describe(self) -> str:
        return "memory://"

    # ---- jobs
    @overload
    def _job(self, job_id: str, create: Literal[True]) -> dict: ...

    @overload
    def _job(self, job_id: str, create: bool = False) -> dict | None: ...

    def _job(self, job_id: str, create: bool = False) -> dict | None:
        """The live job record; with ``create`` a fresh one is made (so never None)."""
        e = self._jobs.get(job_id)
        if e is not None and not e.alive(time.time()):
            del self._jobs[job_id]
            e = None
        if e is None and create:
            e = self._jobs[job_id] = _Expiring({"meta": None, "items": {}}, self.cfg.job_ttl_s)
        return e.value if e is not None else None

    def _touch_job(self, job_id: str) -> None:
        e = self._jobs.get(job_id)
        if e is not None and self.cfg.job_ttl_s:
            e.expires_at = time.time() + self.cfg.job_ttl_s

    def init_job(self, job_id: str, meta: dict) -> dict:
        self._check_id("job id", job_id)
        blob = dump_json(meta)
        with self._lock:
            job = self._job(job_id, create=True)
            if job["meta"] is None:
                job["meta"] = blob
            self._touch_job(job_id)
            return json.loads(job["meta"])

    def get_job_meta(self, job_id: str) -> dict | None:
        with self._lock:
            job = self._job(job_id)
            return json.loads(job["meta"]) if job and job["meta"] is not None else None

    def record_item(self, job_id: str, item_key: str, result: dict) -> bool:
        self._check_id("job id", job_id)
        self._check_id("item key", item_key)
        blob = dump_json(result)
        with self._lock:
            job = self._job(job_id, create=True)
            self._touch_job(job_id)
            if item_key in job["items"]:
                return False
            job["items"][item_key] = blob
            return True

    def finished_items(self, job_id: str) -> set[str]:
        with self._lock:
            job = self._job(job_id)
            return set(job["items"]) if job else set()

    def job_results(self, job_id: str) -> dict[str, dict]:
        with self._lock:
            job = self._job(job_id)
            items = dict(job["items"]) if job else {}
        return {k: json.loads(v) for k, v in items.items()}

    def get_item(self, job_id: str, item_key: str) -> dict | None:
        with self._lock:
            job = self._job(job_id)
            blob = job["items"].get(item_key) if job else None
        return json.loads(blob) if blob is not None else None

    def delete_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def count_items(self, job_id: str) -> int:
        with self._lock:
            job = self._job(job_id)
            return len(job["items"]) if job else 0

    # ---- checkpoints
    def save_checkpoint(self, cp: RequestCheckpoint) -> bool:
        self._check_id("request id", cp.request_id)
        with self._lock:
            old = self.load_checkpoint(cp.request_id)
            if old is not None and old.steps > cp.steps:
                return False
            self._ckpt[cp.request_id] = _Expiring(self._stamp(cp).to_json(), self.cfg.checkpoint_ttl_s)
            return True

    def load_checkpoint(self, request_id: str) -> RequestCheckpoint | None:
        with self._lock:
            e = self._ckpt.get(request_id)
            if e is None:
                return None
            if not e.alive(time.time()):
                del self._ckpt[request_id]
                return None
            return RequestCheckpoint.from_json(e.value)

    def delete_checkpoint(self, request_id: str) -> None:
        with self._lock:
            self._ckpt.pop(request_id, None)

    # ---- KB cache
    def get_kb_hits(self, keys: Sequence[KBKey]) -> list[list[Hit] | None]:
        now = time.time()
        out: list[list[Hit] | None] = []
        with self._lock:
            for key in keys:
                d = key.digest()
                e = self._kb.get(d)
                if e is not None and not e.alive(now):
                    del self._kb[d]
                    e = None
                if e is None:
                    out.append(None)
                else:
                    self._kb.move_to_end(d)
                    out.append(hits_from_json(e.value))
        return out

    def put_kb_hits(self, items: Iterable[tuple[KBKey, Sequence[Hit]]]) -> None:
        cap = self.cfg.memory_kb_cache_entries
        with self._lock:
            for key, hits in items:
                d = key.digest()
                self._kb[d] = _Expiring(hits_to_json(hits), self.cfg.kb_cache_ttl_s)
                self._kb.move_to_end(d)
            while len(self._kb) > cap:
                self._kb.popitem(last=False)
