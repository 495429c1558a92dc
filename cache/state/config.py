"""Configuration of the durable state store (job progress, request checkpoints, KB cache).

The store is chosen by ``url``:

* ``None`` or ``memory://``  - in-process dictionaries (the embedded default; lost on exit);
* ``redis://host:port/db`` or ``rediss://...`` - a Redis server (the cluster setting);
* ``sqlite://PATH`` - a local SQLite file (``sqlite:///abs/path.db`` or
  ``sqlite://relative.db``): durable without a server, used by ``ralmspec eval`` by
  default so that a killed local job can be resumed.

Secrets never live in this config: the Redis password is read from the environment
variable named by ``password_env`` (default ``RALMSPEC_REDIS_PASSWORD``) or from the file
named by ``password_file_env`` (default ``RALMSPEC_REDIS_PASSWORD_FILE``, e.g. a Kubernetes
Secret mounted as a volume). A password written into the URL or the config is rejected.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache.errors import ConfigError

PASSWORD_ENV = "RALMSPEC_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "RALMSPEC_REDIS_PASSWORD_FILE"
STATE_URL_ENV = "RALMSPEC_STATE_URL"

SCHEMES = ("memory", "redis", "rediss", "unix", "sqlite")
_SECRET_KEYS = {"password", "redis_password", "passwd", "pass", "secret", "auth", "requirepass"}


class StateStoreConfigError(ConfigError):
    """The state store configuration is invalid (message is shown to users verbatim)."""


def _password_hint(env: str, file_env: str) -> str:
    return (
        f"put the password in the environment variable {env} (or a file named by "
        f"{file_env}, e.g. a mounted Kubernetes Secret), never in the URL or config file"
    )


def redact_url(url: str | None) -> str:
    """``url`` with any password (user info or query parameter) replaced by ``***``."""
    if not url:
        return "memory://"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{port}" if port else "")
    query = "&".join(
        f"{k}=***" if k.lower() in _SECRET_KEYS else f"{k}={v}"
        for k, vs in parse_qs(parts.query, keep_blank_values=True).items()
        for v in vs
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class StateStoreConfig(BaseModel):
    # hide_input_in_errors: a rejected URL may hold a password; never echo it in errors
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    url: str | None = Field(
        None,
        description="Where state lives. None or 'memory://': in-process (lost on exit). "
        "'redis://host:6379/0' (or rediss:// for TLS, unix:///path.sock): a Redis server, password from "
        "the environment. 'sqlite:///abs/path.db': a local file, durable without a server.",
    )
    key_prefix: str = Field(
        "ralmspec", min_length=1, description="Prefix of every Redis key (lets several deployments share one server)."
    )
    username: str | None = Field(None, description="Redis ACL user name (not secret; None: the default user).")
    password_env: str = Field(PASSWORD_ENV, description="Name of the environment variable holding the Redis password.")
    password_file_env: str = Field(
        PASSWORD_FILE_ENV,
        description="Name of the environment variable holding the path of a file with the Redis password (Kubernetes Secret volume).",
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, description="Socket connect timeout for each attempt to reach the server."
    )
    socket_timeout_s: float = Field(10.0, gt=0, description="Timeout of one command on an established connection.")
    startup_wait_s: float = Field(
        0.0,
        ge=0,
        description="At construction, keep retrying an unreachable server for this long before failing (0: fail at the first attempt). Authentication errors fail at once.",
    )
    retry_timeout_s: float = Field(
        30.0,
        ge=0,
        description="After startup, a command that fails because the server is unreachable or restarting is retried with backoff for at most this long, then raises StateStoreUnavailable.",
    )
    serve_retry_timeout_s: float = Field(
        2.0,
        ge=0,
        description="Serving (coordinators) only: a checkpoint or KB-cache call retries an unreachable server this long, then the request goes on without them (degraded, a warning and the ralmspec_state_store_skipped_total metric) and the server is tried again after serve_cooldown_s. Eval jobs use retry_timeout_s and wait.",
    )
    serve_cooldown_s: float = Field(
        5.0, gt=0, description="Serving only: after a failed call, skip the store for this long before trying again."
    )
    retry_backoff_s: float = Field(0.05, gt=0, description="First retry delay; doubles on every retry.")
    retry_backoff_max_s: float = Field(2.0, gt=0, description="Cap on the retry delay.")
    job_ttl_s: int | None = Field(
        None,
        ge=1,
        description="Expire a job's progress and results this long after its last write (None: keep forever).",
    )
    checkpoint_ttl_s: int | None = Field(
        24 * 3600, ge=1, description="Expire a request checkpoint this long after its last write (None: keep forever)."
    )
    kb_cache_ttl_s: int | None = Field(
        7 * 24 * 3600,
        ge=1,
        description="Expire a cached KB result this long after it was written (None: keep forever).",
    )
    memory_kb_cache_entries: int = Field(
        100_000, ge=0, description="In-memory store only: LRU bound on cached KB results."
    )

    # ---- validation: no secrets in config
    @model_validator(mode="before")
    @classmethod
    def _no_secret_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            bad = sorted(k for k in data if str(k).lower() in _SECRET_KEYS)
            if bad:
                env = data.get("password_env", PASSWORD_ENV)
                fenv = data.get("password_file_env", PASSWORD_FILE_ENV)
                raise StateStoreConfigError(
                    f"state store config must not contain {', '.join(map(repr, bad))}: " + _password_hint(env, fenv)
                )
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        url = url.strip()
        if not url:
            return None
        try:
            parts = urlsplit(url)
            has_password = parts.password is not None
            _ = parts.port
        except ValueError as e:
            raise StateStoreConfigError(f"invalid state store URL {redact_url(url)!r}: {e}") from None
        if parts.scheme not in SCHEMES:
            raise StateStoreConfigError(
                f"unsupported state store URL scheme {parts.scheme!r} in {redact_url(url)!r}: "
                f"use memory://, redis://host:port/db, rediss://..., unix:///path.sock or sqlite:///path.db"
            )
        query = {k.lower() for k in parse_qs(parts.query)}
        if has_password or query & _SECRET_KEYS:
            raise StateStoreConfigError(
                f"the state store URL {redact_url(url)!r} contains a password: "
                + _password_hint(PASSWORD_ENV, PASSWORD_FILE_ENV)
            )
        if parts.scheme == "sqlite" and not url[len("sqlite://") :]:
            raise StateStoreConfigError("sqlite state store URL needs a path: sqlite:///abs/path.db")
        return url

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme if self.url else "memory"

    def read_password(self) -> str | None:
        """The Redis password from the environment (or the file it names), or None."""
        pw = os.environ.get(self.password_env)
        path = os.environ.get(self.password_file_env)
        if pw and path:
            raise StateStoreConfigError(f"both {self.password_env} and {self.password_file_env} are set; set only one")
        if path:
            try:
                with open(path, encoding="utf-8") as fh:
                    pw = fh.read().rstrip("\r\n")
            except OSError as e:
                raise StateStoreConfigError(
                    f"cannot read the Redis password file named by {self.password_file_env} ({path}): {e.strerror}"
                ) from None
            if not pw:
                raise StateStoreConfigError(f"the Redis password file {path} is empty")
        return pw or None

    @classmethod
    def parse(cls, data: dict) -> StateStoreConfig:
        """Validate ``data``; errors come out as one :class:`StateStoreConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            msgs = []
            for err in e.errors():
                msg = str(err.get("msg", ""))
                if msg.startswith("Value error, "):
                    msg = msg[len("Value error, ") :]
                loc = ".".join(str(x) for x in err.get("loc", ()))
                msgs.append(f"{loc}: {msg}" if loc else msg)
            raise StateStoreConfigError("; ".join(msgs)) from None

    @classmethod
    def from_url(cls, url: str | None, **overrides) -> StateStoreConfig:
        return cls.parse({"url": url, **overrides})

    @classmethod
    def from_env(cls, **overrides) -> StateStoreConfig:
        """URL from ``RALMSPEC_STATE_URL`` (unset: memory)."""
        return cls.parse({"url": os.environ.get(STATE_URL_ENV) or None, **overrides})
