"""The state store interface: one API over memory, SQLite and Redis backends.

It holds three kinds of state (docs/design.md, "Architecture"):

(a) **job progress and results** - per job id, the finished item keys and their JSON
    results. :meth:`StateStore.record_item` is atomic and *first write wins*: a result,
    once recorded, is never overwritten, so a resumed job cannot clobber or duplicate it.
(b) **request checkpoints** - the verified prefix of a request (token ids, doc ids, step
    count) keyed by request id, so a replacement coordinator can resume a request whose
    coordinator died. A checkpoint never moves backwards: a stale writer with fewer
    steps than the stored checkpoint is ignored.
(c) **verified KB results** - a cross-request cache keyed by (retriever name, index
    version, query text, k) -> hits. Hits are ``(doc_id, score)`` with the exact float
    score (JSON round-trips Python floats bit for bit).

Values are JSON: every backend serialises on write, so what a test reads back from the
memory store is exactly what it would read back from Redis.
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cache.ranking import Hit
from cache.state.config import StateStoreConfig


class StateStoreError(RuntimeError):
    """Base class of state store failures (messages are shown to users verbatim)."""


class StateStoreUnavailable(StateStoreError):
    """The server cannot be reached (at startup, or for longer than the retry budget)."""


class StateStoreAuthError(StateStoreError):
    """The server rejected the credentials, or needs a password that was not given."""


# ------------------------------------------------------------------ value types
@dataclass
class RequestCheckpoint:
    """The verified prefix of one request: enough to resume it elsewhere.

    ``tokens`` is the whole verified sequence X (question tokens first, ``prompt_len`` of
    them), ``doc_ids`` the KB document of each committed step, ``steps`` their number.
    ``meta`` carries what a resumer needs to rebuild the request (question, retriever,
    spec options, max_new_tokens...). ``updated_at`` is set by the store.
    """

    request_id: str
    tokens: list[int]
    doc_ids: list[int | None]
    steps: int
    prompt_len: int = 0
    meta: dict = field(default_factory=dict)
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("checkpoint needs a request_id")
        if self.steps < 0 or self.steps != len(self.doc_ids):
            raise ValueError(f"checkpoint steps={self.steps} must equal len(doc_ids)={len(self.doc_ids)}")
        if not 0 <= self.prompt_len <= len(self.tokens):
            raise ValueError("checkpoint prompt_len must be within tokens")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> RequestCheckpoint:
        d = json.loads(s)
        return cls(
            request_id=d["request_id"],
            tokens=[int(t) for t in d["tokens"]],
            doc_ids=[None if x is None else int(x) for x in d["doc_ids"]],
            steps=int(d["steps"]),
            prompt_len=int(d.get("prompt_len", 0)),
            meta=d.get("meta") or {},
            updated_at=float(d.get("updated_at", 0.0)),
        )


@dataclass(frozen=True)
class KBKey:
    """Key of a cached KB result. ``index_version`` identifies the index build (e.g. the
    sha256 of its manifest), so results never leak across rebuilt or different indexes."""

    retriever: str
    index_version: str
    query: str
    k: int

    def digest(self) -> str:
        blob = json.dumps(
            [self.retriever, self.index_version, self.query, int(self.k)], ensure_ascii=False, separators=(",", ":")
        )
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def hits_to_json(hits: Sequence[Hit]) -> str:
    return json.dumps([[int(d), float(s)] for d, s in hits], separators=(",", ":"))


def hits_from_json(s: str | bytes) -> list[Hit]:
    return [(int(d), float(sc)) for d, sc in json.loads(s)]


def dump_json(obj: Any) -> str:
    """Compact JSON; raises TypeError for values JSON cannot hold (fail at the writer)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


# ------------------------------------------------------------------ interface
class StateStore(ABC):
    """Durable state shared by coordinators, the serving layer and batch jobs."""

    cfg: StateStoreConfig

    def __init__(self, cfg: StateStoreConfig):
        self.cfg = cfg

    # ---- lifecycle
    @property
    def durable(self) -> bool:
        """Whether recorded state survives the process (False for memory)."""
        return True

    @abstractmethod
    def describe(self) -> str:
        """Where the state lives, safe to log (no password)."""

    def ping(self) -> None:  # noqa: B027 - optional hook: a store that is always usable keeps this no-op
        """Raise :class:`StateStoreError` unless the store is usable."""

    def close(self) -> None:  # noqa: B027 - optional hook: a store with no connection keeps this no-op
        """Release the store's connections (default: nothing to release)."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- (a) jobs
    @abstractmethod
    def init_job(self, job_id: str, meta: dict) -> dict:
        """Create job ``job_id`` with ``meta`` unless it exists; return the stored meta
        (the existing one when the job was created before)."""

    @abstractmethod
    def get_job_meta(self, job_id: str) -> dict | None:
        """The job's meta, or None when there is no such job."""

    @abstractmethod
    def record_item(self, job_id: str, item_key: str, result: dict) -> bool:
        """Atomically record ``item_key`` as finished with ``result``. First write wins:
        returns True if this call recorded it, False if it was already recorded (the
        stored result is kept). After a retried write whose first attempt reached the
        server, the answer may be False although the value is ours."""

    @abstractmethod
    def finished_items(self, job_id: str) -> set[str]:
        """Keys of the job's recorded items."""

    @abstractmethod
    def job_results(self, job_id: str) -> dict[str, dict]:
        """Every recorded item's result, by item key."""

    @abstractmethod
    def get_item(self, job_id: str, item_key: str) -> dict | None:
        """One recorded result, or None."""

    @abstractmethod
    def delete_job(self, job_id: str) -> None:
        """Forget the job's meta and results."""

    def count_items(self, job_id: str) -> int:
        return len(self.finished_items(job_id))

    # ---- (b) request checkpoints
    @abstractmethod
    def save_checkpoint(self, cp: RequestCheckpoint) -> bool:
        """Store ``cp`` unless the stored checkpoint of the request has more steps (a stale
        writer); returns whether it was stored."""

    @abstractmethod
    def load_checkpoint(self, request_id: str) -> RequestCheckpoint | None:
        """The request's checkpoint, or None."""

    @abstractmethod
    def delete_checkpoint(self, request_id: str) -> None:
        """Drop the request's checkpoint (when it completes)."""

    # ---- (c) verified KB results
    @abstractmethod
    def get_kb_hits(self, keys: Sequence[KBKey]) -> list[list[Hit] | None]:
        """Cached hits for each key (None where absent), in one round trip."""

    @abstractmethod
    def put_kb_hits(self, items: Iterable[tuple[KBKey, Sequence[Hit]]]) -> None:
        """Cache verified hits (overwrites; the same key always maps to the same hits)."""

    def get_kb_hit(self, key: KBKey) -> list[Hit] | None:
        return self.get_kb_hits([key])[0]

    def put_kb_hit(self, key: KBKey, hits: Sequence[Hit]) -> None:
        self.put_kb_hits([(key, hits)])

    # ---- helpers for backends
    @staticmethod
    def _stamp(cp: RequestCheckpoint) -> RequestCheckpoint:
        cp.updated_at = time.time()
        return cp

    @staticmethod
    def _check_id(kind: str, value: str) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind} must be a non-empty string")
        return value
