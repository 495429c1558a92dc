"""SQLite state store: durable local state without a server.

Why it exists: ``ralmspec eval`` must be resumable after a kill even on a laptop or a CI
runner without Redis, and the in-process store dies with the process. SQLite is in the
standard library, its transactions are atomic and survive SIGKILL (WAL journal), and
several processes on one machine may share the file. It is *not* for a cluster: pods on
different nodes cannot share it - use Redis there.

URL: ``sqlite:///abs/path.db`` (three slashes + absolute path) or ``sqlite://rel/path.db``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from cache.state.base import (
    Hit,
    KBKey,
    RequestCheckpoint,
    StateStore,
    StateStoreUnavailable,
    dump_json,
    hits_from_json,
    hits_to_json,
)
from cache.state.config import StateStoreConfig

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, meta TEXT NOT NULL, expires_at REAL);
CREATE TABLE IF NOT EXISTS items (job_id TEXT NOT NULL, item_key TEXT NOT NULL, result TEXT NOT NULL,
                                  PRIMARY KEY (job_id, item_key));
CREATE TABLE IF NOT EXISTS checkpoints (request_id TEXT PRIMARY KEY, steps INTEGER NOT NULL,
                                        data TEXT NOT NULL, expires_at REAL);
CREATE TABLE IF NOT EXISTS kb_cache (digest TEXT PRIMARY KEY, hits TEXT NOT NULL, expires_at REAL);
"""


def sqlite_path(url: str) -> Path:
    return Path(url[len("sqlite://") :])


class SqliteStateStore(StateStore):
    def __init__(self, cfg: StateStoreConfig):
        super().__init__(cfg)
        if cfg.url is None:
            raise ValueError("SqliteStateStore needs a sqlite:///path.db URL, got none")
        self.path = sqlite_path(cfg.url)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                str(self.path), timeout=max(cfg.retry_timeout_s, 1.0), check_same_thread=False, isolation_level=None
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StateStoreUnavailable(f"cannot open the SQLite state store {self.path}: {e}") from None
        self._lock = threading.RLock()

    def describe(self) -> str:
        return f"sqlite://{self.path}"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exp(self, ttl: int | None) -> float | None:
        return time.time() + ttl if ttl else None

    def _q(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _tx(self, fn):
        """Run ``fn(cursor)`` in one IMMEDIATE transaction (atomic across processes)."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                out = fn(cur)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            return out

    def _job_alive(self, cur, job_id: str) -> bool:
        row = cur.execute("SELECT expires_at FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None:
            return False
        if row[0] is not None and row[0] <= time.time():
            cur.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))
            cur.execute("DELETE FROM items WHERE job_id=?", (job_id,))
            return False
        return True

    # ---- jobs
    def init_job(self, job_id: str, meta: dict) -> dict:
        self._check_id("job id", job_id)
        blob = dump_json(meta)

        def tx(cur):
            self._job_alive(cur, job_id)
            cur.execute(
                "INSERT OR IGNORE INTO jobs(job_id, meta, expires_at) VALUES (?,?,?)",
                (job_id, blob, self._exp(self.cfg.job_ttl_s)),
            )
            cur.execute("UPDATE jobs SET meta=? WHERE job_id=? AND meta='null'", (blob, job_id))
            if self.cfg.job_ttl_s:
                cur.execute("UPDATE jobs SET expires_at=? WHERE job_id=?", (self._exp(self.cfg.job_ttl_s), job_id))
            return cur.execute("SELECT meta FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0]

        return json.loads(self._tx(tx))

    def get_job_meta(self, job_id: str) -> dict | None:
        def tx(cur):
            if not self._job_alive(cur, job_id):
                return None
            return cur.execute("SELECT meta FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0]

        blob = self._tx(tx)
        return json.loads(blob) if blob is not None else None

    def record_item(self, job_id: str, item_key: str, result: dict) -> bool:
        self._check_id("job id", job_id)
        self._check_id("item key", item_key)
        blob = dump_json(result)

        def tx(cur):
            if not self._job_alive(cur, job_id):
                cur.execute(
                    "INSERT INTO jobs(job_id, meta, expires_at) VALUES (?,?,?)",
                    (job_id, "null", self._exp(self.cfg.job_ttl_s)),
                )
            elif self.cfg.job_ttl_s:
                cur.execute("UPDATE jobs SET expires_at=? WHERE job_id=?", (self._exp(self.cfg.job_ttl_s), job_id))
            cur.execute(
                "INSERT OR IGNORE INTO items(job_id, item_key, result) VALUES (?,?,?)", (job_id, item_key, blob)
            )
            return cur.rowcount == 1

        return bool(self._tx(tx))

    def _items(self, job_id: str, cols: str, extra: str = "", params: tuple = ()) -> list[tuple]:
        def tx(cur):
            if not self._job_alive(cur, job_id):
                return []
            return cur.execute(f"SELECT {cols} FROM items WHERE job_id=?{extra}", (job_id, *params)).fetchall()

        return self._tx(tx)

    def finished_items(self, job_id: str) -> set[str]:
        return {r[0] for r in self._items(job_id, "item_key")}

    def job_results(self, job_id: str) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self._items(job_id, "item_key, result")}

    def get_item(self, job_id: str, item_key: str) -> dict | None:
        rows = self._items(job_id, "result", " AND item_key=?", (item_key,))
        return json.loads(rows[0][0]) if rows else None

    def count_items(self, job_id: str) -> int:
        rows = self._items(job_id, "COUNT(*)")
        return int(rows[0][0]) if rows else 0

    def delete_job(self, job_id: str) -> None:
        def tx(cur):
            cur.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))
            cur.execute("DELETE FROM items WHERE job_id=?", (job_id,))

        self._tx(tx)

    # ---- checkpoints
    def save_checkpoint(self, cp: RequestCheckpoint) -> bool:
        self._check_id("request id", cp.request_id)
        data = self._stamp(cp).to_json()

        def tx(cur):
            row = cur.execute(
                "SELECT steps, expires_at FROM checkpoints WHERE request_id=?", (cp.request_id,)
            ).fetchone()
            if row is not None and (row[1] is None or row[1] > time.time()) and row[0] > cp.steps:
                return False
            cur.execute(
                "INSERT OR REPLACE INTO checkpoints(request_id, steps, data, expires_at) VALUES (?,?,?,?)",
                (cp.request_id, cp.steps, data, self._exp(self.cfg.checkpoint_ttl_s)),
            )
            return True

        return self._tx(tx)

    def load_checkpoint(self, request_id: str) -> RequestCheckpoint | None:
        rows = self._q("SELECT data, expires_at FROM checkpoints WHERE request_id=?", (request_id,))
        if not rows or (rows[0][1] is not None and rows[0][1] <= time.time()):
            return None
        return RequestCheckpoint.from_json(rows[0][0])

    def delete_checkpoint(self, request_id: str) -> None:
        self._tx(lambda cur: cur.execute("DELETE FROM checkpoints WHERE request_id=?", (request_id,)))

    # ---- KB cache
    def get_kb_hits(self, keys: Sequence[KBKey]) -> list[list[Hit] | None]:
        now = time.time()
        out: list[list[Hit] | None] = []
        for key in keys:
            rows = self._q("SELECT hits, expires_at FROM kb_cache WHERE digest=?", (key.digest(),))
            if rows and (rows[0][1] is None or rows[0][1] > now):
                out.append(hits_from_json(rows[0][0]))
            else:
                out.append(None)
        return out

    def put_kb_hits(self, items: Iterable[tuple[KBKey, Sequence[Hit]]]) -> None:
        rows = [(key.digest(), hits_to_json(hits), self._exp(self.cfg.kb_cache_ttl_s)) for key, hits in items]
        if rows:
            self._tx(
                lambda cur: cur.executemany(
                    "INSERT OR REPLACE INTO kb_cache(digest, hits, expires_at) VALUES (?,?,?)", rows
                )
            )
