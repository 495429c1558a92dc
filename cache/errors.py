"""The base configuration error, owned by the bottom layer so that ``cache`` needs nothing of ``ralm``.

:mod:`ralm.errors` re-exports :class:`ConfigError` (the same class object), so
``except ConfigError`` catches errors raised here and in ``ralm`` alike.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration names something that does not exist (unknown retriever, bad path)."""
