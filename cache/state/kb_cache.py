"""A retriever wrapper that serves verified KB results from the state store.

``StoreCachedRetriever(kb, store, index_version)`` answers ``search``/``batch_search``
from the cross-request cache when it can and asks ``kb`` for the rest, then stores
what the KB returned. The cache is exact: the key holds the retriever name, the index
version (e.g. the sha256 of the index manifest), the query text and k, and the KB's
result for a query does not depend on the batch it came in (docs/design.md, "The exactness contract", deterministic retrieval).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.state.base import Hit, KBKey, StateStore


class StoreCachedRetriever:
    def __init__(self, kb, store: StateStore, index_version: str):
        if not index_version:
            raise ValueError("index_version is required (so results never leak across index builds)")
        self.kb = kb
        self.store = store
        self.index_version = index_version
        self.name = getattr(kb, "name", "kb")
        self.scorer = kb.scorer
        self.batch_cost_curve = getattr(kb, "batch_cost_curve", None)  # for the stride scheduler
        self.hits = 0
        self.misses = 0

    def _key(self, query: str, k: int) -> KBKey:
        return KBKey(self.name, self.index_version, query, int(k))

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def speculating(self) -> None:
        """Passed on to the KB underneath when it batches several requests' calls (a
        scheduling hint: a speculation window opened, no KB call until its verification)."""
        hint = getattr(self.kb, "speculating", None)
        if hint is not None:
            hint()

    def sharing(self) -> int:
        """The KB underneath's count of requests sharing its batches (0 when it has none)."""
        count = getattr(self.kb, "sharing", None)
        return int(count()) if count is not None else 0

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        keys = [self._key(q, k) for q in queries]
        cached = self.store.get_kb_hits(keys)
        missing = [i for i, c in enumerate(cached) if c is None]
        self.hits += len(queries) - len(missing)
        self.misses += len(missing)
        if missing:
            fresh = self.kb.batch_search([queries[i] for i in missing], k)
            self.store.put_kb_hits((keys[i], hits) for i, hits in zip(missing, fresh))
            for i, hits in zip(missing, fresh):
                cached[i] = [(int(d), float(s)) for d, s in hits]
        return cached  # type: ignore[return-value]
