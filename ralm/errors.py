"""Errors raised for bad input; their messages are shown to users verbatim.

:class:`ConfigError` is defined in :mod:`cache.errors` (the bottom layer raises it too)
and re-exported here as the same class object.
"""

from __future__ import annotations

from cache.errors import ConfigError

__all__ = ["ConfigError", "InvariantUnavailable", "Overloaded", "RalmInputError", "RequestCancelled"]


class RalmInputError(ValueError):
    """A request is invalid (empty or over-long question, bad parameter)."""


class InvariantUnavailable(RalmInputError):
    """The model or the machine cannot run the invariant forward (see the message)."""


class Overloaded(Exception):
    """The server is at capacity (its bounded queues are full): retry after ``retry_after_s``.

    Answered as HTTP 503 with a ``Retry-After`` header; nothing of the request was started."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)


class RequestCancelled(Exception):
    """The request was cancelled (its client went away or its deadline passed) and stopped
    between two steps; what it held (coordinator, caches, KV sessions) is freed."""
