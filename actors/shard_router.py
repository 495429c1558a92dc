"""The shard router: :class:`ShardedRetriever`, the KB over the shard actors of :mod:`actors.shard`.

It implements the :class:`~ralm.retrieval.base.Retriever` protocol: every query goes to
every shard, each returns its exact top-k (global doc ids), and the router merges them with
:func:`~ralm.retrieval.base.rank_hits`, i.e. by (score desc, doc id asc) - the unsharded
answer, since every shard scores with the unsharded scores (why, for dense and for BM25:
:mod:`actors.shard`). The router encodes each query once: the dense encoder's vector, or the
BM25 query built from the *global* term statistics it collects from the shards
(:mod:`ralm.retrieval.shard_scoring`); the kind's family makes that scorer
(:mod:`ralm.retrievers`).

Fault tolerance: a call whose shard died is resubmitted (:meth:`ShardedRetriever._call`)
until the shard is back (restarted by Ray) or ``retry_timeout_s`` has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ralm.config import RetrieverConfig
from ralm.retrieval.base import Hit, rank_hits
from ralm.retrievers import entry

log = logging.getLogger(__name__)

_RETRYABLE: tuple = ()


def _retryable() -> tuple:
    global _RETRYABLE
    if not _RETRYABLE:
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        _RETRYABLE = (RayActorError, ActorUnavailableError, GetTimeoutError)
    return _RETRYABLE


class ShardedRetriever:
    """:class:`~ralm.retrieval.base.Retriever` over shard actors; merges per-shard exact top-k."""

    def __init__(
        self,
        kind: str,
        shards: Sequence[Any],
        bounds: Sequence[tuple[int, int]],
        rcfg: RetrieverConfig | dict | None = None,
        encoder: Any = None,
        retry_timeout_s: float = 120.0,
    ):
        self.kind = kind
        self.name = kind
        self.shards = list(shards)
        self.bounds = [tuple(b) for b in bounds]
        self._los = np.array([lo for lo, _ in self.bounds], dtype=np.int64)
        if rcfg is None:
            rcfg = RetrieverConfig(kind=kind)
        self.rcfg = rcfg if isinstance(rcfg, RetrieverConfig) else RetrieverConfig.model_validate(rcfg)
        self.retry_timeout_s = retry_timeout_s
        self.retries = 0
        self.calls = 0

        self.entry = entry(kind)
        self.scorer: Any = self.entry.family.router_scorer(self, self.rcfg, encoder)

    # ---- fan-out with retries
    def _call(
        self, method: str, args_per_shard: Sequence[tuple] | None = None, shard_ids: Sequence[int] | None = None
    ) -> list[Any]:
        """Call ``method`` on the given shards (all by default) and wait; a call that fails
        because its shard died is resubmitted until the shard is back (restarted by Ray)."""
        import ray

        shard_ids = list(range(len(self.shards))) if shard_ids is None else list(shard_ids)
        args = list(args_per_shard) if args_per_shard is not None else [()] * len(shard_ids)
        self.calls += 1
        refs = {i: getattr(self.shards[i], method).remote(*a) for i, a in zip(shard_ids, args)}
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.retry_timeout_s
        delay = 0.05
        for i, a in zip(shard_ids, args):
            while True:
                try:
                    out[i] = ray.get(refs[i], timeout=max(1.0, deadline - time.monotonic()))
                    break
                except _retryable() as e:
                    if time.monotonic() >= deadline:
                        raise
                    self.retries += 1
                    log.warning("shard %d of %s failed (%s); retrying", i, self.kind, type(e).__name__)
                    time.sleep(delay)
                    delay = min(1.0, delay * 2)
                    refs[i] = getattr(self.shards[i], method).remote(*a)
        return [out[i] for i in shard_ids]

    def shard_of(self, doc_id: int) -> int:
        return int(np.searchsorted(self._los, int(doc_id), side="right") - 1)

    def fetch_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        groups: dict[int, list[int]] = {}
        for d in doc_ids:
            groups.setdefault(self.shard_of(d), []).append(int(d))
        sids = sorted(groups)
        res = self._call("doc_keys", [(groups[s],) for s in sids], sids)
        got = {d: key for s, keys in zip(sids, res) for d, key in zip(groups[s], keys)}
        return [got[int(d)] for d in doc_ids]

    def term_stats(self, terms: Sequence[str]) -> list[dict]:
        return self._call("term_stats", [(list(terms),)] * len(self.shards))

    # ---- Retriever protocol
    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = list(queries)
        if not queries:
            return []
        if k <= 0:
            return [[] for _ in queries]
        reps = self.scorer.encode(queries)
        method, args = self.scorer.shard_call(queries, reps, k)
        per_shard = self._call(method, [args] * len(self.shards))
        out = []
        for qi in range(len(queries)):
            ids = [d for res in per_shard for d, _ in res[qi]]
            scores = [s for res in per_shard for _, s in res[qi]]
            out.append(rank_hits(ids, scores, k))
        return out

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def infos(self) -> list[dict]:
        return self._call("info")
