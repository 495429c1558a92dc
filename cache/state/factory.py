"""Open the state store a configuration (or a bare URL) names."""

from __future__ import annotations

from cache.state.base import StateStore
from cache.state.config import StateStoreConfig
from cache.state.memory import MemoryStateStore
from cache.state.sqlite_store import SqliteStateStore


def open_state_store(cfg: StateStoreConfig | str | None = None, **overrides) -> StateStore:
    """A ready-to-use store: memory for ``None``/``memory://``, Redis for ``redis://``,
    ``rediss://`` and ``unix://``, SQLite for ``sqlite://PATH``.

    Redis stores ping the server here, so a missing server or a wrong password fails at
    startup (:class:`~cache.state.base.StateStoreUnavailable`,
    :class:`~cache.state.base.StateStoreAuthError`), never mid-request.
    """
    if cfg is None or isinstance(cfg, str):
        cfg = StateStoreConfig.from_url(cfg, **overrides)
    elif overrides:
        cfg = StateStoreConfig.parse({**cfg.model_dump(), **overrides})
    scheme = cfg.scheme
    if scheme == "memory":
        return MemoryStateStore(cfg)
    if scheme in ("redis", "rediss", "unix"):
        # lazy: keeps the redis client out of processes that use the memory or SQLite store
        from cache.state.redis_store import RedisStateStore

        return RedisStateStore(cfg)
    if scheme == "sqlite":
        return SqliteStateStore(cfg)
    raise AssertionError(scheme)  # the config validator rejects other schemes


def store_from_env(**overrides) -> StateStore:
    """The store named by ``RALMSPEC_STATE_URL`` (unset: memory)."""
    return open_state_store(StateStoreConfig.from_env(**overrides))
