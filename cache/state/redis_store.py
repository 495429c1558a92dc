"""Redis state store: shared by every coordinator, replica and batch job of a cluster.

Key layout (``P`` = ``cfg.key_prefix``)::

    P:job:<job id>:meta     string  JSON meta of the job (SET NX: first creator wins)
    P:job:<job id>:items    hash    item key -> JSON result (HSETNX: first write wins)
    P:ckpt:<request id>     hash    {steps, data}; a Lua script refuses older checkpoints
    P:kb:<sha256 of key>    string  JSON hits

Failure handling:

* **Startup**: the constructor pings the server. No server -> :class:`StateStoreUnavailable`;
  a missing or wrong password -> :class:`StateStoreAuthError`. Both say what to fix.
* **Mid-job restarts**: a command that fails because the server is down, restarting or
  still loading its append-only file is retried with exponential backoff for at most
  ``retry_timeout_s`` and then raises :class:`StateStoreUnavailable`. Every write is
  idempotent (HSETNX, SET NX, compare-and-set, plain SET), so a retry after a lost reply
  is harmless. Nothing acknowledged is lost if the server persists (``appendonly yes``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    ConnectionError as RedisConnectionError,
    ReadOnlyError,
    ResponseError,
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry

from cache.state.base import (
    Hit,
    KBKey,
    RequestCheckpoint,
    StateStore,
    StateStoreAuthError,
    StateStoreUnavailable,
    dump_json,
    hits_from_json,
    hits_to_json,
)
from cache.state.config import StateStoreConfig, redact_url

log = logging.getLogger(__name__)
T = TypeVar("T")

_RETRYABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)

# KEYS[1] checkpoint hash; ARGV: data, steps, ttl seconds (0: none). Returns 1 if stored.
_SAVE_CHECKPOINT_LUA = """
local old = redis.call('HGET', KEYS[1], 'steps')
if old and tonumber(old) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'steps', ARGV[2], 'data', ARGV[1])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) else redis.call('PERSIST', KEYS[1]) end
return 1
"""


class RedisStateStore(StateStore):
    def __init__(self, cfg: StateStoreConfig):
        super().__init__(cfg)
        if cfg.url is None or cfg.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"RedisStateStore needs a redis://, rediss:// or unix:// URL, got {redact_url(cfg.url)}")
        self._password = cfg.read_password()
        kwargs = dict(
            socket_connect_timeout=cfg.connect_timeout_s,
            socket_timeout=cfg.socket_timeout_s,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            client_name="ralmspec",
        )
        if self._password is not None:
            kwargs["password"] = self._password
        if cfg.username:
            kwargs["username"] = cfg.username
        self._r = redis.Redis.from_url(cfg.url, **kwargs)
        self._p = cfg.key_prefix
        self._save_ckpt = self._r.register_script(_SAVE_CHECKPOINT_LUA)
        self._startup_ping()

    # ---------------------------------------------------------------- plumbing
    def describe(self) -> str:
        return f"{redact_url(self.cfg.url)} (key prefix {self._p!r})"

    def _auth_error(self, e: Exception) -> StateStoreAuthError:
        where = redact_url(self.cfg.url)
        msg = str(e)
        if self._password is None:
            return StateStoreAuthError(
                f"Redis at {where} requires a password and none was given: set the environment "
                f"variable {self.cfg.password_env} (or {self.cfg.password_file_env} to a file "
                f"holding it, e.g. a mounted Kubernetes Secret). Server said: {msg}"
            )
        if "without any password configured" in msg or "no password is set" in msg.lower():
            return StateStoreAuthError(
                f"Redis at {where} has no password configured, but {self.cfg.password_env}/"
                f"{self.cfg.password_file_env} provided one: unset it or configure requirepass "
                f"on the server. Server said: {msg}"
            )
        return StateStoreAuthError(
            f"Redis at {where} rejected the password from {self.cfg.password_env}/"
            f"{self.cfg.password_file_env} (wrong password or user"
            f"{' ' + repr(self.cfg.username) if self.cfg.username else ''}). Server said: {msg}"
        )

    @staticmethod
    def _is_auth_response(e: ResponseError) -> bool:
        s = str(e)
        return (
            s.startswith(("NOAUTH", "WRONGPASS"))
            or "AUTH" in s.split(" ", 3)[:3]
            or "without any password configured" in s
        )

    def _startup_ping(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_wait_s
        delay = self.cfg.retry_backoff_s
        while True:
            try:
                self._r.ping()
                return
            except AuthenticationError as e:
                raise self._auth_error(e) from None
            except ResponseError as e:
                if self._is_auth_response(e):
                    raise self._auth_error(e) from None
                raise StateStoreUnavailable(
                    f"Redis at {redact_url(self.cfg.url)} answered PING with an error: {e}"
                ) from None
            except _RETRYABLE as e:
                now = time.monotonic()
                if now >= deadline:
                    raise StateStoreUnavailable(
                        f"cannot reach the Redis state store at {redact_url(self.cfg.url)}: {e}. "
                        f"Is redis-server running there? (locally: `make system-deps` installs it; "
                        f"on Kubernetes: check the ralmspec-redis Service and pod; or drop the state "
                        f"URL to use the in-process store)"
                    ) from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, self.cfg.retry_backoff_max_s)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; on connection loss retry with backoff for ``retry_timeout_s``."""
        deadline: float | None = None
        delay = self.cfg.retry_backoff_s
        attempts = 0
        err: Exception
        while True:
            try:
                out = fn()
                if attempts:
                    log.warning(
                        "Redis state store at %s is back after %d retries (%s)",
                        redact_url(self.cfg.url),
                        attempts,
                        what,
                    )
                return out
            except AuthenticationError as e:
                raise self._auth_error(e) from None
            except ResponseError as e:
                if isinstance(e, ReadOnlyError):
                    err = e
                elif self._is_auth_response(e):
                    raise self._auth_error(e) from None
                else:
                    raise
            except _RETRYABLE as e:
                err = e
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.cfg.retry_timeout_s
                log.warning(
                    "Redis state store at %s unavailable during %s (%s); retrying for up to %.0f s",
                    redact_url(self.cfg.url),
                    what,
                    err,
                    self.cfg.retry_timeout_s,
                )
            if now >= deadline:
                raise StateStoreUnavailable(
                    f"Redis state store at {redact_url(self.cfg.url)} has been unreachable for "
                    f"{self.cfg.retry_timeout_s:.0f} s (during {what}; {attempts} retries): {err}. "
                    f"Nothing acknowledged before was lost if the server persists its data "
                    f"(appendonly yes); rerun the job with the same job id to resume."
                ) from None
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, self.cfg.retry_backoff_max_s)
            attempts += 1

    def ping(self) -> None:
        self._call("ping", self._r.ping)

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    # ---------------------------------------------------------------- jobs
    def _expire_job(self, pipe, job_id: str) -> None:
        if self.cfg.job_ttl_s:
            pipe.expire(self._k("job", job_id, "meta"), self.cfg.job_ttl_s)
            pipe.expire(self._k("job", job_id, "items"), self.cfg.job_ttl_s)

    def init_job(self, job_id: str, meta: dict) -> dict:
        self._check_id("job id", job_id)
        blob = dump_json(meta)
        key = self._k("job", job_id, "meta")

        def op():
            pipe = self._r.pipeline(transaction=True)
            pipe.set(key, blob, nx=True)
            pipe.get(key)
            self._expire_job(pipe, job_id)
            return pipe.execute()[1]

        return json.loads(self._call("init_job", op))

    def get_job_meta(self, job_id: str) -> dict | None:
        blob = self._call("get_job_meta", lambda: self._r.get(self._k("job", job_id, "meta")))
        return json.loads(blob) if blob is not None else None

    def record_item(self, job_id: str, item_key: str, result: dict) -> bool:
        self._check_id("job id", job_id)
        self._check_id("item key", item_key)
        blob = dump_json(result)
        key = self._k("job", job_id, "items")

        def op():
            pipe = self._r.pipeline(transaction=True)
            pipe.hsetnx(key, item_key, blob)
            self._expire_job(pipe, job_id)
            return pipe.execute()[0]

        return bool(self._call("record_item", op))

    def finished_items(self, job_id: str) -> set[str]:
        # the client decodes responses (decode_responses=True), so the field names are str
        keys = self._call("finished_items", lambda: self._r.hkeys(self._k("job", job_id, "items")))
        return set(cast("list[str]", keys))

    def job_results(self, job_id: str) -> dict[str, dict]:
        key = self._k("job", job_id, "items")
        raw = self._call("job_results", lambda: dict(self._r.hscan_iter(key, count=1000)))
        return {k: json.loads(v) for k, v in raw.items()}

    def get_item(self, job_id: str, item_key: str) -> dict | None:
        blob = self._call("get_item", lambda: self._r.hget(self._k("job", job_id, "items"), item_key))
        return json.loads(blob) if blob is not None else None

    def count_items(self, job_id: str) -> int:
        return int(self._call("count_items", lambda: self._r.hlen(self._k("job", job_id, "items"))))

    def delete_job(self, job_id: str) -> None:
        self._call(
            "delete_job", lambda: self._r.delete(self._k("job", job_id, "meta"), self._k("job", job_id, "items"))
        )

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, cp: RequestCheckpoint) -> bool:
        self._check_id("request id", cp.request_id)
        data = self._stamp(cp).to_json()
        key = self._k("ckpt", cp.request_id)
        ttl = self.cfg.checkpoint_ttl_s or 0
        return bool(self._call("save_checkpoint", lambda: self._save_ckpt(keys=[key], args=[data, cp.steps, ttl])))

    def load_checkpoint(self, request_id: str) -> RequestCheckpoint | None:
        blob = self._call("load_checkpoint", lambda: self._r.hget(self._k("ckpt", request_id), "data"))
        return RequestCheckpoint.from_json(blob) if blob is not None else None

    def delete_checkpoint(self, request_id: str) -> None:
        self._call("delete_checkpoint", lambda: self._r.delete(self._k("ckpt", request_id)))

    # ---------------------------------------------------------------- KB cache
    def get_kb_hits(self, keys: Sequence[KBKey]) -> list[list[Hit] | None]:
        if not keys:
            return []
        names = [self._k("kb", key.digest()) for key in keys]
        raw = self._call("get_kb_hits", lambda: self._r.mget(names))
        return [hits_from_json(v) if v is not None else None for v in raw]

    def put_kb_hits(self, items: Iterable[tuple[KBKey, Sequence[Hit]]]) -> None:
        rows = [(self._k("kb", key.digest()), hits_to_json(hits)) for key, hits in items]
        if not rows:
            return
        ttl = self.cfg.kb_cache_ttl_s

        def op():
            pipe = self._r.pipeline(transaction=False)
            for name, blob in rows:
                pipe.set(name, blob, ex=ttl)
            pipe.execute()

        self._call("put_kb_hits", op)
