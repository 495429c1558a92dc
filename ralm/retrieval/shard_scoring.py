"""The KB's exact scorers as the shard router sees them (:class:`actors.shard_router.ShardedRetriever`).

A speculative cache scores its cached documents with the KB's own scoring function, so
the router exposes one: queries are encoded here (the dense encoder, or BM25 analysis over
the *global* term statistics summed over the shards) and document keys are fetched from
the shards that own them and kept in an LRU. With these, the coordinator's cache ranks
documents bit for bit as the unsharded KB would. A scorer also says which shard method
answers a batch of encoded queries (:meth:`shard_call`); a retriever family makes its
scorer (:attr:`ralm.retrievers.Family.router_scorer`).

Pure Python over the router's two calls (:class:`ShardRouter`): no Ray here.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ralm.retrieval.bm25 import BM25ScoreFn, build_bm25_query
from ralm.retrieval.dense import dense_scores
from ralm.retrieval.lucene_env import JVM_LOCK, ensure_lucene


class ShardRouter(Protocol):
    """What the scorers need of the router (:class:`actors.shard_router.ShardedRetriever`)."""

    def fetch_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        """The document keys of ``doc_ids``, from the shards that own them."""

    def term_stats(self, terms: Sequence[str]) -> list[dict]:
        """Per shard: ``doc_count``, ``sum_total_term_freq`` and the ``df`` of each term."""


class _ShardScorer(ABC):
    """The KB's exact scorer seen by the router: encode here, keys from the owning shards."""

    def __init__(self, router: ShardRouter, key_cache_size: int = 100_000):
        self.router = router
        self._keys: OrderedDict[int, Any] = OrderedDict()
        self._max = key_cache_size
        self._lock = threading.Lock()

    def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        ids = [int(d) for d in doc_ids]
        with self._lock:
            missing = list(dict.fromkeys(d for d in ids if d not in self._keys))
        if missing:
            fetched = self.router.fetch_keys(missing)
            with self._lock:
                self._keys.update(zip(missing, fetched))
                while len(self._keys) > self._max:
                    self._keys.popitem(last=False)
        with self._lock:
            return [self._keys[d] for d in ids]

    def score(self, query_rep: Any, keys: Sequence[Any]) -> np.ndarray:
        return self.score_function()(query_rep, keys)

    @abstractmethod
    def score_function(self) -> Callable[[Any, Sequence[Any]], np.ndarray]:
        """The KB's pure scoring function, ``(query_rep, keys) -> float64 scores``."""

    @abstractmethod
    def shard_call(self, queries: Sequence[str], reps: Sequence[Any], k: int) -> tuple[str, tuple]:
        """The shard method (of :class:`actors.shard.RetrievalShard`) and its arguments that
        return each shard's exact top-``k`` of ``queries`` (``reps``: their :meth:`encode`)."""


def dense_score_fn(query_rep: np.ndarray, keys) -> np.ndarray:
    """The dense KB's pure scoring function, in the ``(query_rep, keys)`` order of a scorer."""
    return dense_scores(keys, query_rep)


class ShardedDenseScorer(_ShardScorer):
    def __init__(self, router: ShardRouter, encoder: Any):
        super().__init__(router)
        self.encoder = encoder

    def encode(self, queries: Sequence[str]) -> list[np.ndarray]:
        return self.encoder.encode_queries(list(queries))

    def score_function(self):
        return dense_score_fn

    def shard_call(self, queries: Sequence[str], reps: Sequence[Any], k: int) -> tuple[str, tuple]:
        return "search_vectors", (reps, k)


class ShardedBM25Scorer(_ShardScorer):
    """Global BM25 over the shards: analysis here, statistics summed over the shards (dfs).

    ``encode_one`` builds the representation with the unsharded KB's own builder
    (:func:`~ralm.retrieval.bm25.build_bm25_query`) over the global statistics, so a
    query's representation is bit for bit the unsharded KB's.
    """

    def __init__(self, router: ShardRouter, k1: float, b: float, language: str = "en"):
        super().__init__(router)
        ensure_lucene()
        from pyserini.analysis import Analyzer, get_lucene_analyzer

        self.k1, self.b = float(k1), float(b)
        with JVM_LOCK:  # pyserini's JVM is entered by one thread at a time
            self.analyzer = Analyzer(get_lucene_analyzer(language=language))
        stats = router.term_stats([])
        self.doc_count = sum(s["doc_count"] for s in stats)
        self.sum_total_term_freq = sum(s["sum_total_term_freq"] for s in stats)
        self.avgdl = self.sum_total_term_freq / self.doc_count if self.doc_count else 1.0
        self._fn = BM25ScoreFn(self.k1, self.b, self.avgdl)
        self._df: dict[str, int] = {}
        self._df_lock = threading.Lock()
        self._memo: OrderedDict[str, Any] = OrderedDict()

    def analyze(self, text: str) -> list[str]:
        with JVM_LOCK:
            return list(self.analyzer.analyze(text))

    def df(self, term: str) -> int:
        with self._df_lock:
            d = self._df.get(term)
        if d is None:
            self._fetch_df([term])
            d = self._df[term]
        return d

    def _fetch_df(self, terms: list[str]) -> None:
        stats = self.router.term_stats(terms)
        with self._df_lock:
            for j, t in enumerate(terms):
                self._df[t] = sum(int(s["df"][j]) for s in stats)

    def encode_one(self, text: str, terms: list[str] | None = None) -> Any:
        """:meth:`BM25Scorer.encode_one` over global statistics: the same
        :func:`~ralm.retrieval.bm25.build_bm25_query` with the summed df and ``docCount``
        (``terms``: ``text`` already analysed)."""
        return build_bm25_query(self.analyze(text) if terms is None else terms, self.df, self.doc_count)

    def encode(self, queries: Sequence[str]) -> list[Any]:
        queries = list(queries)
        todo = [q for q in dict.fromkeys(queries) if q not in self._memo]
        if todo:
            analysed = {q: self.analyze(q) for q in todo}
            with self._df_lock:
                missing = sorted({t for ts in analysed.values() for t in ts} - set(self._df))
            if missing:
                self._fetch_df(missing)  # one dfs round trip for the whole batch
            for q in todo:
                self._memo[q] = self.encode_one(q, analysed[q])
            while len(self._memo) > 65536:
                self._memo.popitem(last=False)
        return [self._memo[q] for q in queries]

    def score_function(self):
        return self._fn

    def shard_call(self, queries: Sequence[str], reps: Sequence[Any], k: int) -> tuple[str, tuple]:
        return "search_bm25", (list(queries), reps, self.avgdl, k)
