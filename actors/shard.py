"""Retrieval shards: the slices of a KB, each served by a Ray actor.

The corpus is split into ``N`` contiguous slices ``[lo, hi)``; doc ids stay global (a
shard adds ``lo`` to its local row numbers). Each :class:`RetrievalShard` - run as a Ray
actor by :func:`start_shards` - holds the index of its slice, loaded from disk:

- **dense** (edr / adr): the slice's rows of the full index's ``vectors.npy`` (never
  re-encoded: passage encoding is batch-dependent, slicing keeps the very same float32 keys)
  with the kind's FAISS index over them, built once by :func:`prepare_shards`;
- **sparse** (sr): a Lucene index of the slice's passages.

How a kind's slice is built and opened is its family's (:mod:`ralm.retrievers`,
:mod:`ralm.retrieval.kinds`).

The router, :class:`~actors.shard_router.ShardedRetriever`, implements the
:class:`~ralm.retrieval.base.Retriever` protocol over the shards: every shard returns its
exact top-k (global doc ids) and the router merges them with :func:`~ralm.retrieval.base.rank_hits`, i.e. by (score desc,
doc id asc). The union of every shard's exact top-k contains the global top-k, so the
merge is the unsharded answer *provided each shard scores with the unsharded scores*:

- **dense**: the exact score is :func:`~ralm.retrieval.dense.dense_scores` of the same
  float32 vectors, a pure per-row function: identical by construction (the router
  encodes each query once and sends the vector to every shard). EDR sharded == EDR
  unsharded. ADR: each shard's HNSW graph is another approximate index, so sharded ADR is
  its own (deterministic) KB; seq and spec over it still agree token for token.
- **sr (BM25)**: like Elasticsearch's ``dfs_query_then_fetch``. The router analyses the
  query and asks every shard for the document frequencies of its terms (cached per
  term), and sums them with the shards' ``docCount`` and ``sumTotalTermFreq``: the global
  statistics, the same integers the unsharded index has. With them it builds the query
  representation exactly as the unsharded :class:`~ralm.retrieval.bm25.BM25Scorer` does
  (same analysis, and the same :func:`~ralm.retrieval.bm25.build_bm25_query`; tested
  equal to the unsharded representations). Each shard takes Lucene candidates from its slice
  index (ranked with *local* statistics) and re-scores them with the global query and
  global ``avgdl`` (the shared :func:`~ralm.retrieval.bm25.bm25_scores`). The candidate
  bound is converted from local to global scores: for any document of the shard,
  ``global <= R * local`` with ``R = max_t(idf_global(t) / idf_local(t)) * max(1, avgdl_global / avgdl_local)``
  (per term, the tf-part ratio lies between 1 and ``avgdl_g/avgdl_l``), so the
  expansion loop of :func:`~ralm.retrieval.rerank.exact_top_k` fetches more candidates
  until the global k-th score is clearly above ``R * bound``. The result is the exact
  top-k of the slice under global BM25, hence the merge equals the unsharded result.

Fault tolerance: shard actors restart (``max_restarts``) and reload their slice from
disk in ``__init__``; in-flight calls are retried by Ray (``max_task_retries``) and, on
top of that, by the router (:meth:`~actors.shard_router.ShardedRetriever._call`) until
``retry_timeout_s``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actors.metrics import record_shard_search
from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.base import Hit
from ralm.retrieval.bm25 import SparseRetriever, bm25_scores
from ralm.retrieval.dense import DenseRetriever
from ralm.retrieval.factory import ensure_index
from ralm.retrieval.index_build import MANIFEST, validate_index
from ralm.retrieval.rerank import Candidates, exact_top_k, tolerance
from ralm.retrievers import entry

log = logging.getLogger(__name__)

SHARD_INFO = "shard.json"


# ---------------------------------------------------------------------------- layout
def shard_bounds(n_docs: int, n_shards: int) -> list[tuple[int, int]]:
    """``n_shards`` contiguous, balanced ``[lo, hi)`` slices of ``range(n_docs)``."""
    if n_shards < 1:
        raise ValueError("n_shards must be >= 1")
    if n_shards > n_docs:
        raise ValueError(f"cannot split {n_docs} passages into {n_shards} shards")
    base, extra = divmod(n_docs, n_shards)
    out, lo = [], 0
    for i in range(n_shards):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def shard_root(index_dir: str | Path, n_shards: int) -> Path:
    index_dir = Path(index_dir)
    return index_dir.parent / f"{index_dir.name}-{n_shards}shards"


def sub_corpus(corpus: Corpus, lo: int, hi: int) -> Corpus:
    """Passages ``lo..hi-1`` as a corpus of their own (local row = global row - lo)."""
    return Corpus.from_records(
        [{"id": corpus.ids[i], "title": corpus.titles[i], "contents": corpus.contents[i]} for i in range(lo, hi)]
    )


@dataclass(frozen=True)
class ShardSpec:
    """Everything a shard actor needs to (re)load its slice from disk."""

    kind: str
    index: int
    n_shards: int
    lo: int
    hi: int
    shard_dir: str
    retriever: dict  # RetrieverConfig as a dict

    @property
    def rcfg(self) -> RetrieverConfig:
        return RetrieverConfig.model_validate(self.retriever)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_shards(
    rcfg: RetrieverConfig,
    corpus: Corpus,
    index_dir: str | Path,
    n_shards: int,
    progress: bool = False,
) -> list[ShardSpec]:
    """Build (once) the slice indexes of the full index at ``index_dir``; return their specs.

    The full index is built first if missing (a dense one from the corpus' passage vectors,
    encoded once per encoder and shared: :mod:`ralm.retrieval.passage_vectors`). A shard
    directory is rebuilt when it was made from another full index (``shard.json`` records its
    manifest's sha256).
    """
    e = entry(rcfg.kind)
    kind = e.kind
    index_dir = Path(index_dir)
    ensure_index(rcfg, corpus, index_dir, progress=progress)
    manifest = validate_index(index_dir, rcfg, corpus, checksums=False)
    source = _sha256(index_dir / MANIFEST)
    root = shard_root(index_dir, n_shards)
    specs = []
    build_cfg = rcfg.model_copy(update={"pad_to": 0})
    for i, (lo, hi) in enumerate(shard_bounds(len(corpus), n_shards)):
        d = root / f"shard-{i:03d}"
        info = {"kind": kind, "index": i, "n_shards": n_shards, "lo": lo, "hi": hi, "source_manifest": source}
        info_path = d / SHARD_INFO
        current = None
        if info_path.is_file():
            try:
                current = json.loads(info_path.read_text())
            except (OSError, json.JSONDecodeError):
                current = None
        if current != info or not (d / MANIFEST).is_file():
            if info_path.exists():
                info_path.unlink()
            sub = sub_corpus(corpus, lo, hi)
            log.info("building %s shard %d/%d (passages %d..%d) in %s", kind, i + 1, n_shards, lo, hi - 1, d)
            e.family.build_slice(e, build_cfg, index_dir, manifest, sub, lo, hi, d, progress)
            info_path.write_text(json.dumps(info, indent=2, sort_keys=True))
        specs.append(ShardSpec(kind, i, n_shards, lo, hi, str(d), rcfg.model_dump(mode="json")))
    return specs


# ---------------------------------------------------------------------------- one shard
class RetrievalShard:
    """One slice of a KB (body of the shard actor). Every doc id it takes or returns is global."""

    def __init__(self, spec: ShardSpec, corpus_path: str | None = None):
        self.spec = spec
        self.kind = spec.kind
        self.lo, self.hi = spec.lo, spec.hi
        self.n_docs = spec.hi - spec.lo
        self.started = time.time()
        self.pid = os.getpid()
        self.calls = 0
        rcfg = spec.rcfg
        self.entry = entry(spec.kind)
        self.local = self.entry.family.open_slice(self.entry, rcfg, Path(spec.shard_dir), self.n_docs, spec.n_shards)
        self.stats = {"searches": 0, "queries": 0, "expansions": 0}

    # ---- identity / health
    def info(self) -> dict:
        return {
            "kind": self.kind,
            "index": self.spec.index,
            "lo": self.lo,
            "hi": self.hi,
            "pid": self.pid,
            "started": self.started,
            "calls": self.calls,
            **self.stats,
            **self._scan_info(),
        }

    def _scan_info(self) -> dict:
        """An exact dense shard's candidate paths and the timings ``auto`` chose them by."""
        if not isinstance(self.local, DenseRetriever) or not self.entry.scan:
            return {}
        plan = self.local.plan
        return {
            "dense_scan": self.local.scan_label,
            "dense_scan_timings_ms": plan.timings,
            "dense_scan_batch_cost": self.local.batch_cost_curve,
        }

    def ping(self) -> int:
        return self.pid

    def _dense(self) -> DenseRetriever:
        """The slice's dense retriever (dense-family shards only)."""
        if not isinstance(self.local, DenseRetriever):
            raise TypeError(f"shard {self.spec.index} is a {self.kind!r} shard: no dense index to search")
        return self.local

    def _sparse(self) -> SparseRetriever:
        """The slice's Lucene retriever (sparse-family shards only)."""
        if not isinstance(self.local, SparseRetriever):
            raise TypeError(f"shard {self.spec.index} is a {self.kind!r} shard: no Lucene index to search")
        return self.local

    # ---- dense
    def search_vectors(self, reps: Sequence[np.ndarray], k: int) -> list[list[Hit]]:
        """Exact top-``k`` of this slice for encoded queries (global doc ids)."""
        self.calls += 1
        self.stats["searches"] += 1
        self.stats["queries"] += len(reps)
        t0 = time.perf_counter()
        res = self._dense().search_vectors(list(reps), min(int(k), self.n_docs))
        out = [[(d + self.lo, s) for d, s in hits] for hits in res]
        self._observe(time.perf_counter() - t0)
        return out

    # ---- sparse: global statistics (dfs phase) and search with global weights
    def term_stats(self, terms: Sequence[str]) -> dict:
        """This slice's ``docCount``, ``sumTotalTermFreq`` and the df of each analysed term."""
        self.calls += 1
        sc = self._sparse().scorer
        return {
            "doc_count": sc.doc_count,
            "sum_total_term_freq": sc.sum_total_term_freq,
            "df": [sc.df(t) for t in terms],
        }

    def search_bm25(self, texts: Sequence[str], reps: Sequence[Any], avgdl: float, k: int) -> list[list[Hit]]:
        """Exact top-``k`` of this slice under *global* BM25 (``reps``: global query reps)."""
        self.calls += 1
        self.stats["searches"] += 1
        self.stats["queries"] += len(texts)
        t0 = time.perf_counter()
        loc = self._sparse()
        sc = loc.scorer
        k = min(int(k), self.n_docs)
        out = []
        for text, gq in zip(texts, reps):
            if not gq.terms:
                out.append(self._globalize(loc._zero_fill([], k)))
                continue
            R = _bound_ratio(gq, sc.encode_one(text), avgdl, sc.avgdl)

            def candidates(n: int, text=text, R=R) -> Candidates:
                ids, scores = loc.lucene_search(text, n)
                if not len(scores):
                    return Candidates(ids=ids, bound=None, complete=True)
                b = float(scores[-1])
                return Candidates(ids=ids, bound=R * (b + tolerance(b)), complete=len(ids) < n)

            def rescore(ids, gq=gq) -> np.ndarray:
                return bm25_scores(gq, sc.doc_keys(ids), sc.k1, sc.b, avgdl)

            hits, _ = exact_top_k(k, k + loc.rerank_margin, self.n_docs, candidates, rescore, self.stats)
            out.append(self._globalize(loc._zero_fill(hits, k)))
        self._observe(time.perf_counter() - t0)
        return out

    def _observe(self, seconds: float) -> None:
        record_shard_search(self.kind, self.spec.index, seconds)

    def _globalize(self, hits: list[Hit]) -> list[Hit]:
        return [(d + self.lo, s) for d, s in hits]

    # ---- keys for the local caches
    def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        """Exact-scorer keys of global ``doc_ids`` (all in this slice)."""
        self.calls += 1
        local = [int(d) - self.lo for d in doc_ids]
        if any(d < 0 or d >= self.n_docs for d in local):
            raise ValueError(f"doc ids outside shard {self.spec.index} [{self.lo}, {self.hi})")
        keys = self.local.scorer.doc_keys(local)
        # vector keys are copied: a view would send the whole matrix
        return [np.array(k) if isinstance(k, np.ndarray) else k for k in keys]


def _bound_ratio(global_q, local_q, avgdl_g: float, avgdl_l: float) -> float:
    """R with ``global_score(d) <= R * local_score(d)`` for every document of the shard."""
    local_w = dict(zip(local_q.terms, local_q.weights))
    r = 1.0
    for t, w in zip(global_q.terms, global_q.weights):
        lw = local_w.get(t)
        if lw:  # a term absent from the slice contributes 0 to all its docs
            r = max(r, w / lw)
    return r * max(1.0, avgdl_g / avgdl_l if avgdl_l > 0 else 1.0)


# ---------------------------------------------------------------------------- actors
def shard_actor_class(num_cpus: float = 0.25, max_restarts: int = 5, max_task_retries: int = 3):
    """``ray.remote`` class of :class:`RetrievalShard` with restart/retry options."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=max_task_retries)(RetrievalShard)


SHARD_NAMESPACE = "ralmspec"


def start_shards(
    specs: Sequence[ShardSpec],
    num_cpus: float = 0.25,
    max_restarts: int = 5,
    max_task_retries: int = 3,
    wait: bool = True,
    name_prefix: str | None = None,
    resources: dict[str, float] | None = None,
    spread: bool = False,
    num_gpus: float = 0,
) -> list[Any]:
    """Start one actor per shard spec (each loads its slice in ``__init__``).

    ``name_prefix``: name the actors ``{prefix}-{i}`` in namespace ``ralmspec`` (for operators
    and tests: ``ray.get_actor(name, namespace="ralmspec")``). ``resources``: custom Ray
    resources per shard (pins shards to the nodes that offer them); ``spread``: Ray's SPREAD
    scheduling over those nodes. A shard whose node dies is restarted on another such node.
    ``num_gpus``: GPUs per shard (an exact-dense scan with ``dense_scan: gpu`` runs there).
    """
    import ray

    cls = shard_actor_class(num_cpus, max_restarts, max_task_retries)
    actors = []
    for s in specs:
        opts: dict[str, Any] = {"name": f"{name_prefix}-{s.index}", "namespace": SHARD_NAMESPACE} if name_prefix else {}
        if resources:
            opts["resources"] = dict(resources)
        if spread:
            opts["scheduling_strategy"] = "SPREAD"
        if num_gpus:
            opts["num_gpus"] = float(num_gpus)
        actors.append(cls.options(**opts).remote(s))
    if wait:
        ray.get([a.ping.remote() for a in actors])
    return actors
