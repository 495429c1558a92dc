"""Errors raised for bad input; their messages are shown to users verbatim.

:class:`ConfigError` is defined in :mod:`cache.errors` (the bottom layer raises it too)
and re-exported here as the same class object.
"""

from __future__ import annotations

from cache.errors import ConfigError

__all__ = ["ConfigError", "RalmInputError"]


class RalmInputError(ValueError):
    """A request is invalid (empty or over-long question, bad parameter)."""
