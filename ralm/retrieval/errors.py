"""Errors raised when a retriever or its on-disk index cannot be used.

All derive from :class:`ValueError`, and every message says what to do about it.
"""

from __future__ import annotations

from ralm.retrievers import UnknownRetrieverError

__all__ = [
    "CorruptIndexError",
    "IndexMismatchError",
    "IndexNotFoundError",
    "RetrieverIndexError",
    "UnknownRetrieverError",
]


class RetrieverIndexError(ValueError):
    """Base class: an index directory cannot be used."""


class IndexNotFoundError(RetrieverIndexError):
    """There is no (complete) index at the given directory."""


class CorruptIndexError(RetrieverIndexError):
    """An index file is missing, truncated, modified or unreadable."""


class IndexMismatchError(RetrieverIndexError):
    """The index was built for another corpus, encoder, kind or parameters."""
