"""Sparse KB retriever (SR): BM25 over a pyserini/Lucene index, re-scored exactly.

Lucene (through pyserini's ``LuceneSearcher``) generates candidates; :class:`BM25Scorer`
re-scores them in float64 with the formula of Lucene 9's ``BM25Similarity``:

* query: the text analysed by the index's analyzer; a term occurring ``c`` times is
  one clause with boost ``c`` (Anserini's ``BagOfWordsQueryGenerator``);
* ``idf = log(1 + (N - df + 0.5) / (df + 0.5))`` with ``N`` = Lucene's ``docCount``
  of the field (documents with at least one indexed term);
* term score ``c * idf * tf / (tf + k1 * (1 - b + b * dl / avgdl))`` where ``dl`` is the
  document length *as Lucene stores it* - a lossy one-byte norm
  (``SmallFloat.intToByte4``), decoded with ``byte4ToInt`` - and
  ``avgdl = sumTotalTermFreq / docCount``.

Document keys are term-frequency dicts from the stored document vectors (the index
is built with ``storeDocvectors``), plus the quantised length. Global statistics come
from the index reader (document frequencies are cached per term), so a shard of the
KB can score with the statistics of the whole KB.

Two quirks of pyserini/Anserini worth knowing: ``LuceneSearcher`` returns scores rounded
to 4 decimal places (Anserini's ``ScoreTiesAdjusterReranker``), which only affects the
candidate bound (covered by the expansion tolerance); and documents that match no query
term are never returned by Lucene - here they rank after every match with score 0.0,
by doc id, exactly as the local cache ranks them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ralm import constants as C
from ralm.retrieval.base import Hit, rank_hits
from ralm.retrieval.lucene_env import JVM_LOCK, ensure_lucene
from ralm.retrieval.rerank import Candidates, exact_top_k

log = logging.getLogger(__name__)

FIELD = "contents"

# ---------------------------------------------------------------- Lucene SmallFloat


def _long_to_int4(i: int) -> int:
    if i < 0:
        raise ValueError("only non-negative values can be encoded")
    num_bits = i.bit_length()
    if num_bits < 4:
        return i  # subnormal
    shift = num_bits - 4
    encoded = (i >> shift) & 0x07  # keep 4 most significant bits, drop the implicit one
    return encoded | ((shift + 1) << 3)


def _int4_to_long(i: int) -> int:
    bits = i & 0x07
    shift = (i >> 3) - 1
    return bits if shift == -1 else (bits | 0x08) << shift


_MAX_INT4 = _long_to_int4(2**31 - 1)
_NUM_FREE_VALUES = 255 - _MAX_INT4


def int_to_byte4(i: int) -> int:
    """Lucene ``SmallFloat.intToByte4`` (as an unsigned byte 0..255)."""
    if i < 0:
        raise ValueError("only non-negative values can be encoded")
    if i < _NUM_FREE_VALUES:
        return i
    return _NUM_FREE_VALUES + _long_to_int4(i - _NUM_FREE_VALUES)


def byte4_to_int(b: int) -> int:
    """Lucene ``SmallFloat.byte4ToInt`` (of an unsigned byte 0..255)."""
    b &= 0xFF
    if b < _NUM_FREE_VALUES:
        return b
    return _NUM_FREE_VALUES + _int4_to_long(b - _NUM_FREE_VALUES)


def lucene_length(n_tokens: int) -> int:
    """The document length Lucene's BM25 sees for a field of ``n_tokens`` tokens."""
    return byte4_to_int(int_to_byte4(int(n_tokens)))


# ---------------------------------------------------------------- exact scoring


@dataclass(frozen=True)
class BM25Query:
    """Query representation: distinct analysed terms (sorted) and their weights count*idf."""

    terms: tuple[str, ...]
    weights: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.terms)


@dataclass(frozen=True)
class BM25DocKey:
    """Document key: term frequencies and the Lucene-quantised length."""

    tf: dict
    dl: int


def bm25_idf(df: int, n_docs: int) -> float:
    """Lucene 9 ``BM25Similarity`` idf of a term in ``df`` of ``n_docs`` documents.

    ``log(1 + (N - df + 0.5) / (df + 0.5))`` with ``N`` Lucene's ``docCount`` of the field.
    """
    return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))


def build_bm25_query(terms: Iterable[str], df: Callable[[str], int], n_docs: int) -> BM25Query:
    """The query representation of the analysed ``terms`` - THE builder KB and shards share.

    Distinct terms in sorted order, each weighted ``count * idf(df)`` (a term occurring
    ``count`` times is one clause with boost ``count``); terms with ``df == 0`` match no
    document and are dropped. ``df`` maps a term to its document frequency and ``n_docs``
    is ``docCount``: the unsharded index passes its own statistics, the shard router the
    statistics summed over the shards (the same integers), so both build the same floats.
    """
    counts: dict[str, int] = {}
    for t in terms:
        counts[t] = counts.get(t, 0) + 1
    out_terms, weights = [], []
    for t in sorted(counts):
        d = df(t)
        if d == 0:
            continue  # matches nothing, contributes nothing
        out_terms.append(t)
        weights.append(counts[t] * bm25_idf(d, n_docs))
    return BM25Query(tuple(out_terms), tuple(weights))


def bm25_scores(query: BM25Query, keys: Sequence[BM25DocKey], k1: float, b: float, avgdl: float) -> np.ndarray:
    """Exact float64 BM25 of ``query`` against each key - THE function KB and cache share.

    Each document's score is built by the same elementwise float64 operations, term by
    term in the query's (sorted) order, whatever the other documents.
    """
    n = len(keys)
    total = np.zeros(n, dtype=np.float64)
    if n == 0 or not query.terms:
        return total
    dl = np.fromiter((key.dl for key in keys), dtype=np.float64, count=n)
    norm = k1 * ((1.0 - b) + b * dl / avgdl)
    for term, w in zip(query.terms, query.weights):
        tf = np.fromiter((key.tf.get(term, 0) for key in keys), dtype=np.float64, count=n)
        total = total + w * (tf / (tf + norm))
    return total


@dataclass(frozen=True)
class BM25ScoreFn:
    """:func:`bm25_scores` bound to the index's constants: a picklable pure function
    ``(query_rep, keys) -> float64 scores`` (for remote caches)."""

    k1: float
    b: float
    avgdl: float

    def __call__(self, query_rep: BM25Query, keys: Sequence[BM25DocKey]) -> np.ndarray:
        return bm25_scores(query_rep, keys, self.k1, self.b, self.avgdl)


def _parse_java_map(text: str, size: int) -> dict[str, int] | None:
    """Parse ``java.util.Map.toString()`` of term -> count, e.g. ``"{copi=2, tree=1}"``.

    One JNI call per document instead of three per term (about 30x faster). Returns None
    when the text does not split into exactly ``size`` well-formed entries (a term that
    contains ", " or "="), so the caller falls back to walking the map.
    """
    if size == 0:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        return None
    out: dict[str, int] = {}
    for item in text[1:-1].split(", "):
        term, sep, count = item.rpartition("=")
        if not sep or not term or not count.isdigit() or term in out:
            return None
        out[term] = int(count)
    return out if len(out) == size else None


class BM25Scorer:
    """ExactScorer for BM25 over a Lucene index (global statistics from the index reader)."""

    def __init__(
        self,
        index_dir: str | Path,
        k1: float = C.BM25_K1,
        b: float = C.BM25_B,
        corpus_ids: Sequence[str] | None = None,
        key_cache_size: int = 200_000,
        language: str = "en",
    ):
        ensure_lucene()
        self.index_dir = str(index_dir)
        self.k1 = float(k1)
        self.b = float(b)
        self.corpus_ids = list(corpus_ids) if corpus_ids is not None else None
        self._df: dict[str, int] = {}
        self._keys: OrderedDict[int, BM25DocKey] = OrderedDict()
        self._key_cache_size = key_cache_size
        # analysed queries by text (LRU): a query the cache has just encoded (a speculative
        # step, a direct step's probe) is not analysed again by the KB search that follows
        self._queries: OrderedDict[str, BM25Query] = OrderedDict()
        self._lock = threading.Lock()
        with JVM_LOCK:
            self._open(language)
        self._score_fn = BM25ScoreFn(self.k1, self.b, self.avgdl)

    def _open(self, language: str) -> None:
        from jnius import autoclass
        from pyserini.analysis import Analyzer, get_lucene_analyzer
        from pyserini.index.lucene import LuceneIndexReader

        self.reader = LuceneIndexReader(self.index_dir)
        self.janalyzer = get_lucene_analyzer(language=language)
        self.analyzer = Analyzer(self.janalyzer)
        jr = self.reader.reader
        self.doc_count = int(jr.getDocCount(FIELD))  # Lucene's N
        self.sum_total_term_freq = int(jr.getSumTotalTermFreq(FIELD))
        self.max_doc = int(jr.maxDoc())
        self.avgdl = self.sum_total_term_freq / self.doc_count if self.doc_count else 1.0
        self._JTerm = autoclass("org.apache.lucene.index.Term")
        finfo = autoclass("org.apache.lucene.index.FieldInfos").getMergedFieldInfos(jr).fieldInfo(FIELD)
        if finfo is not None and not finfo.hasVectors():
            raise ValueError(
                f"Lucene index at {self.index_dir} has no stored document vectors for "
                f"{FIELD!r}: rebuild it with storeDocvectors (ralmspec index --retriever sr)"
            )

    # ---- statistics
    def df(self, term: str) -> int:
        """Document frequency of an analysed term (cached)."""
        d = self._df.get(term)
        if d is None:
            # straight from Lucene: pyserini's get_term_counts(analyzer=None) re-analyses the
            # term with a non-stemming analyzer (e.g. 'i.' -> 'i'), which is not the indexed term
            with JVM_LOCK:
                d = int(self.reader.reader.docFreq(self._JTerm(FIELD, term)))
            self._df[term] = d
        return d

    # ---- ExactScorer protocol
    def analyze(self, text: str) -> list[str]:
        with JVM_LOCK:
            return list(self.analyzer.analyze(text))

    def encode_one(self, text: str) -> BM25Query:
        with self._lock:
            q = self._queries.get(text)
            if q is not None:
                self._queries.move_to_end(text)
                return q
        with JVM_LOCK:
            q = self._encode_locked(text)
        with self._lock:
            self._queries[text] = q
            while len(self._queries) > C.BM25_QUERY_MEMO:
                self._queries.popitem(last=False)
        return q

    def _encode_locked(self, text: str) -> BM25Query:
        return build_bm25_query(self.analyze(text), self.df, self.doc_count)

    def encode(self, queries: Sequence[str]) -> list[BM25Query]:
        return [self.encode_one(q) for q in queries]

    def _string_id(self, doc_id: int) -> str:
        if self.corpus_ids is not None:
            return self.corpus_ids[int(doc_id)]
        with JVM_LOCK:
            return self.reader.convert_internal_docid_to_collection_docid(int(doc_id))

    def _fetch_key(self, doc_id: int) -> BM25DocKey:
        with JVM_LOCK:
            return self._fetch_key_locked(doc_id)

    def _fetch_key_locked(self, doc_id: int) -> BM25DocKey:
        try:
            jmap = self.reader.object.getDocumentVector(self.reader.reader, self._string_id(doc_id))
        except Exception as e:  # jnius.JavaException
            if "NotStored" not in str(e) and "not stored" not in str(e):
                raise
            jmap = None  # a document with no indexed term has no vector
        tf: dict[str, int] = {}
        if jmap is not None:
            parsed = _parse_java_map(jmap.toString(), int(jmap.size()))
            if parsed is not None:
                tf = parsed
            else:  # a term with ", " or "=" in it: walk the map (slow, exact)
                it = jmap.entrySet().iterator()
                while it.hasNext():
                    entry = it.next()
                    tf[entry.getKey()] = int(entry.getValue())
        return BM25DocKey(tf=tf, dl=lucene_length(sum(tf.values())))

    def clear_caches(self) -> None:
        """Forget cached document term vectors and analysed queries (benchmarks start every
        request cold)."""
        with self._lock:
            self._keys.clear()
            self._queries.clear()

    def doc_keys(self, doc_ids: Sequence[int] | np.ndarray) -> list[BM25DocKey]:
        out = []
        for d in doc_ids:
            d = int(d)
            with self._lock:
                key = self._keys.get(d)
                if key is not None:
                    self._keys.move_to_end(d)
            if key is None:
                key = self._fetch_key(d)
                with self._lock:
                    self._keys[d] = key
                    while len(self._keys) > self._key_cache_size:
                        self._keys.popitem(last=False)
            out.append(key)
        return out

    def score_function(self) -> BM25ScoreFn:
        """The pure scoring function ``(query_rep, keys) -> float64 scores`` (picklable)."""
        return self._score_fn

    def score(self, query_rep: BM25Query, keys: Sequence[BM25DocKey]) -> np.ndarray:
        return self._score_fn(query_rep, keys)

    def score_ids(self, query_rep: BM25Query, doc_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.score(query_rep, self.doc_keys(doc_ids))

    def close(self) -> None:
        try:
            with JVM_LOCK:
                self.reader.reader.close()
        except Exception:  # pragma: no cover
            pass


class SparseRetriever:
    """SR: Lucene BM25 candidates + exact float64 BM25 re-scoring (:class:`BM25Scorer`).

    ``corpus_ids``: the corpus's string ids in row order (doc id = row).

    Candidates come from a plain Lucene ``IndexSearcher`` with ``BM25Similarity(k1, b)``
    and Anserini's ``BagOfWordsQueryGenerator`` (the query pyserini's ``LuceneSearcher``
    runs), read with their raw float32 scores. ``LuceneSearcher.search`` itself is not
    used for candidates: Anserini rounds its scores to 4 decimals and then separates
    ties by subtracting 1e-6 per tied rank (``ScoreTiesAdjusterReranker``), so for a
    large group of tied documents the returned scores drift below the true ones by more
    than any fixed tolerance, and the candidate bound would be wrong. It stays available
    as :attr:`searcher` (for display and comparisons).
    """

    name = "sr"

    def __init__(
        self,
        index_dir: str | Path,
        corpus_ids: Sequence[str],
        k1: float = C.BM25_K1,
        b: float = C.BM25_B,
        rerank_margin: int = C.RERANK_MARGIN,
    ):
        ensure_lucene()
        from jnius import autoclass

        self.kind = "sr"
        self.index_dir = str(index_dir)
        self.corpus_ids = list(corpus_ids)
        self._row_of = {s: i for i, s in enumerate(self.corpus_ids)}
        self.n_docs = len(self.corpus_ids)
        self.scorer = BM25Scorer(index_dir, k1=k1, b=b, corpus_ids=self.corpus_ids)
        if self.scorer.max_doc != self.n_docs:
            raise ValueError(
                f"Lucene index at {index_dir} has {self.scorer.max_doc} documents, the corpus {self.n_docs}"
            )
        with JVM_LOCK:
            IndexSearcher = autoclass("org.apache.lucene.search.IndexSearcher")
            BM25Similarity = autoclass("org.apache.lucene.search.similarities.BM25Similarity")
            self._jsearcher = IndexSearcher(self.scorer.reader.reader)
            self._jsearcher.setSimilarity(BM25Similarity(float(k1), float(b)))
            self._qgen = autoclass("io.anserini.search.query.BagOfWordsQueryGenerator")()
        self._internal_row = np.full(self.scorer.max_doc, -1, dtype=np.int64)
        self._searcher = None
        self.rerank_margin = int(rerank_margin)
        self.padded_rows = 0
        self.stats = {"searches": 0, "expansions": 0}

    def __repr__(self) -> str:
        return f"SparseRetriever(n_docs={self.n_docs}, k1={self.scorer.k1}, b={self.scorer.b})"

    @property
    def searcher(self):
        """pyserini ``LuceneSearcher`` on the same index with ``set_bm25(k1, b)`` (lazy)."""
        if self._searcher is None:
            from pyserini.search.lucene import LuceneSearcher

            with JVM_LOCK:
                self._searcher = LuceneSearcher(self.index_dir)
                self._searcher.set_bm25(self.scorer.k1, self.scorer.b)
        return self._searcher

    # ---- Lucene candidates
    def _rows(self, internal: list[int]) -> np.ndarray:
        rows = self._internal_row
        missing = [d for d in internal if rows[d] < 0]
        if missing:
            with JVM_LOCK:
                stored = self._jsearcher.storedFields()
                for d in missing:
                    rows[d] = self._row_of[stored.document(d).get("id")]
        return rows[np.asarray(internal, dtype=np.int64)] if internal else np.zeros(0, dtype=np.int64)

    def lucene_search(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Lucene's own top-``k``: (doc ids, raw float32 scores as float64), Lucene's order."""
        with JVM_LOCK:
            query_obj = self._qgen.buildQuery(FIELD, self.scorer.janalyzer, query)
            top = self._jsearcher.search(query_obj, int(k))
            docs = top.scoreDocs
            internal = [int(sd.doc) for sd in docs]
            scores = np.array([float(sd.score) for sd in docs], dtype=np.float64)
        return self._rows(internal), scores

    def lucene_scores(self, query: str, k: int) -> list[Hit]:
        """Lucene's own top-``k`` as hits (float32 scores, not rounded): for tests."""
        ids, scores = self.lucene_search(query, k)
        return [(int(d), float(s)) for d, s in zip(ids, scores)]

    def _zero_fill(self, hits: list[Hit], k: int) -> list[Hit]:
        """Append unmatched documents (score 0.0) in id order until there are k hits."""
        if len(hits) >= k:
            return hits
        present = {d for d, _ in hits}
        extra: list[int] = []
        d = 0
        while len(hits) + len(extra) < k and d < self.n_docs:
            if d not in present:
                extra.append(d)
            d += 1
        ids = [h[0] for h in hits] + extra
        scores = [h[1] for h in hits] + [0.0] * len(extra)
        return rank_hits(ids, scores, k)

    def _resolve(self, text: str, q: BM25Query, k: int) -> list[Hit]:
        if not q.terms:
            return self._zero_fill([], k)

        def candidates(n: int) -> Candidates:
            ids, scores = self.lucene_search(text, n)
            return Candidates(ids=ids, bound=float(scores[-1]) if len(scores) else None, complete=len(ids) < n)

        hits, _ = exact_top_k(
            k, k + self.rerank_margin, self.n_docs, candidates, lambda ids: self.scorer.score_ids(q, ids), self.stats
        )
        return self._zero_fill(hits, k)

    def search_reps(self, queries: Sequence[str], reps: Sequence[BM25Query], k: int) -> list[list[Hit]]:
        """Top-``k`` for queries whose representations are already computed."""
        if k <= 0:
            return [[] for _ in queries]
        self.stats["searches"] += len(queries)
        return [self._resolve(t, r, k) for t, r in zip(queries, reps)]

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Each query is searched on its own (Lucene has no batched kernel to share)."""
        queries = list(queries)
        return self.search_reps(queries, self.scorer.encode(queries), k)

    def close(self) -> None:
        if self._searcher is not None:
            try:
                self._searcher.close()
            except Exception:  # pragma: no cover
                pass
        self.scorer.close()
