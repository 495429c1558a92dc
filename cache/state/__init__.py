"""Durable state: job progress and results, request checkpoints, verified KB results.

One interface (:class:`StateStore`), three backends: in-process memory (the default),
Redis (``redis://``, for clusters) and SQLite (``sqlite://PATH``, durable local state
without a server). :func:`open_state_store` picks one from a URL or a
:class:`StateStoreConfig`. Passwords come from ``RALMSPEC_REDIS_PASSWORD`` or the file
named by ``RALMSPEC_REDIS_PASSWORD_FILE``, never from a URL or config file.
"""

from cache.state.base import (
    Hit,
    KBKey,
    RequestCheckpoint,
    StateStore,
    StateStoreAuthError,
    StateStoreError,
    StateStoreUnavailable,
)
from cache.state.config import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    STATE_URL_ENV,
    StateStoreConfig,
    StateStoreConfigError,
    redact_url,
)
from cache.state.factory import open_state_store, store_from_env
from cache.state.kb_cache import StoreCachedRetriever

__all__ = [
    "Hit",
    "KBKey",
    "RequestCheckpoint",
    "StateStore",
    "StateStoreAuthError",
    "StateStoreError",
    "StateStoreUnavailable",
    "StateStoreConfig",
    "StateStoreConfigError",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "STATE_URL_ENV",
    "redact_url",
    "open_state_store",
    "store_from_env",
    "StoreCachedRetriever",
]
