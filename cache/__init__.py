"""Caches: the per-request local speculative cache, doc-KV caches and state stores."""

from cache.speculative import SpeculativeCache

__all__ = ["SpeculativeCache"]
