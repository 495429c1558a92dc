"""The built-in retriever kinds and their two families (a provider of :mod:`ralm.retrievers`).

* **dense** (:data:`DENSE`): ``vectors.npy`` (the encoder's float32 passage vectors, one row per
  passage) and ``index.faiss`` (the kind's FAISS index over them), searched by
  :class:`~ralm.retrieval.dense.DenseRetriever`; a shard slices the full index's vectors (never
  re-encodes them) and the router sends it encoded queries.
* **sparse** (:data:`SPARSE`): ``lucene/`` (a pyserini/Anserini Lucene index), searched by
  :class:`~ralm.retrieval.bm25.SparseRetriever`; a shard indexes its slice's passages and the
  router scores with the global BM25 statistics summed over the shards.

The kinds: ``edr`` (exact dense: a flat inner-product index, scanned whole), ``adr``
(approximate dense: an HNSW graph) and ``sr`` (sparse: BM25).
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ralm import retrievers
from ralm.retrieval.bm25 import SparseRetriever
from ralm.retrieval.dense import DenseRetriever, build_faiss_index
from ralm.retrieval.errors import CorruptIndexError
from ralm.retrieval.index_build import LUCENE_SUBDIR, build_index, build_lucene, check_encoder, write_vectors
from ralm.retrieval.lucene_env import JVM_LOCK
from ralm.retrieval.passage_vectors import cache_file, passage_vectors
from ralm.retrieval.shard_scoring import ShardedBM25Scorer, ShardedDenseScorer
from ralm.retrieval.shared_encoder import get_encoder
from ralm.retrievers import Family, RetrieverEntry

log = logging.getLogger(__name__)

_SKIP_FILES = {"write.lock"}


def _versions(packages: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


# ---------------------------------------------------------------------------- dense
class _EncoderInfo:
    """Stands in for the encoder when a shard's index is built from given vectors: the full
    index's encoder as its manifest records it."""

    def __init__(self, info: dict):
        self.name = info["name"]
        self.fingerprint = info["fingerprint"]
        self.dim = int(info["dim"])


def _dense_build(
    e: RetrieverEntry,
    corpus,
    out_dir: Path,
    cfg,
    manifest: dict,
    *,
    progress: bool = True,
    encoder: Any = None,
    batch_size: int = 64,
    vectors: np.ndarray | None = None,
    vectors_cache=None,
    **_: Any,
) -> None:
    import faiss

    enc = encoder if encoder is not None else get_encoder(cfg.encoder)
    if vectors is None:
        vectors, source = passage_vectors(
            corpus, enc, cache_dir=vectors_cache, progress=progress, batch_size=batch_size
        )
    else:
        source = {"source": "given"}
    manifest["vectors"] = source
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.shape != (len(corpus), enc.dim):
        raise ValueError(f"vectors have shape {vectors.shape}, expected ({len(corpus)}, {enc.dim})")
    for p in (out_dir / "vectors.npy", out_dir / "index.faiss"):
        if p.exists():
            p.unlink()
    write_vectors(
        vectors,
        out_dir / "vectors.npy",
        None if source["source"] == "given" else cache_file(corpus, enc, vectors_cache),
    )
    index = build_faiss_index(e, vectors, cfg, progress=progress)
    faiss.write_index(index, str(out_dir / "index.faiss"))
    manifest["encoder"] = {"name": enc.name, "fingerprint": enc.fingerprint, "dim": int(vectors.shape[1])}


def _dense_files(out_dir: Path) -> list[Path]:
    return [out_dir / "vectors.npy", out_dir / "index.faiss"]


def _dense_versions() -> dict[str, str]:
    out = _versions(("faiss-cpu", "torch", "transformers"))
    if "faiss-cpu" not in out:
        try:
            import faiss

            out["faiss"] = faiss.__version__
        except Exception:  # pragma: no cover
            pass
    return out


def _dense_retriever(e: RetrieverEntry, cfg, encoder: Any, vectors: np.ndarray, index: Any, pad_to: int):

    return DenseRetriever(
        e.kind,
        encoder,
        vectors,
        index,
        hnsw_m=cfg.hnsw_m,
        ef_construction=cfg.hnsw_ef_construction,
        ef_search=cfg.hnsw_ef_search,
        pad_to=pad_to if e.scan else 0,
        rerank_margin=cfg.rerank_margin,
        faiss_threads=cfg.faiss_threads,
        dense_scan=cfg.dense_scan,
    )


def _dense_load(e: RetrieverEntry, cfg, corpus, index_dir: Path, manifest: dict, encoder: Any, hint: str):
    import faiss

    enc = encoder if encoder is not None else get_encoder(cfg.encoder)
    check_encoder(manifest, enc, index_dir)
    try:
        vectors = np.load(index_dir / "vectors.npy", allow_pickle=False)
        index = faiss.read_index(str(index_dir / "index.faiss"))
    except Exception as ex:
        raise CorruptIndexError(f"index at {index_dir} is unreadable ({type(ex).__name__}: {ex}); {hint}") from None
    if vectors.shape != (len(corpus), manifest["encoder"]["dim"]) or vectors.dtype != np.float32:
        raise CorruptIndexError(
            f"index at {index_dir}: vectors.npy has shape {vectors.shape} "
            f"{vectors.dtype}, expected ({len(corpus)}, {manifest['encoder']['dim']}) float32; {hint}"
        )
    if int(index.ntotal) != len(corpus):
        raise CorruptIndexError(
            f"index at {index_dir}: index.faiss has {index.ntotal} rows, expected {len(corpus)}; {hint}"
        )
    return _dense_retriever(e, cfg, enc, vectors, index, cfg.pad_to)


def _dense_build_slice(e, cfg, full_dir: Path, manifest: dict, sub, lo: int, hi: int, out_dir: Path, progress: bool):

    vectors = np.load(full_dir / "vectors.npy", mmap_mode="r")
    build_index(
        e.kind,
        sub,
        out_dir,
        cfg,
        progress=progress,
        encoder=_EncoderInfo(manifest["encoder"]),
        vectors=np.asarray(vectors[lo:hi]),
    )


def _dense_open_slice(e: RetrieverEntry, cfg, shard_dir: Path, n_docs: int, n_shards: int):
    import faiss

    vectors = np.load(shard_dir / "vectors.npy", allow_pickle=False)
    index = faiss.read_index(str(shard_dir / "index.faiss"))
    if vectors.shape[0] != n_docs or int(index.ntotal) != n_docs:
        raise ValueError(
            f"shard at {shard_dir}: {vectors.shape[0]} vectors / {index.ntotal} rows, "
            f"expected {n_docs}; delete {shard_dir.parent} to rebuild the shards"
        )
    pad = -(-cfg.pad_to // n_shards) if cfg.pad_to else 0  # each shard scans its share of the padding
    return _dense_retriever(e, cfg, None, vectors, index, pad)


def _dense_router_scorer(router, cfg, encoder: Any):

    return ShardedDenseScorer(router, encoder if encoder is not None else get_encoder(cfg.encoder))


DENSE = Family(
    name="dense",
    encodes=True,
    build=_dense_build,
    index_files=_dense_files,
    versions=_dense_versions,
    load=_dense_load,
    build_slice=_dense_build_slice,
    open_slice=_dense_open_slice,
    router_scorer=_dense_router_scorer,
)


# ---------------------------------------------------------------------------- sparse
def _sparse_build(e: RetrieverEntry, corpus, out_dir: Path, cfg, manifest: dict, *, progress=True, threads=1, **_):

    with JVM_LOCK:
        build_lucene(corpus, out_dir / LUCENE_SUBDIR, threads, progress)
    manifest["encoder"] = None


def _sparse_files(out_dir: Path) -> list[Path]:
    root = out_dir / LUCENE_SUBDIR
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in _SKIP_FILES)


def _sparse_versions() -> dict[str, str]:
    out = _versions(("pyserini",))
    try:
        from jnius import autoclass

        with JVM_LOCK:
            out["lucene"] = str(autoclass("org.apache.lucene.util.Version").LATEST.toString())
    except Exception:  # pragma: no cover
        pass
    return out


def _sparse_retriever(cfg, lucene_dir: Path, ids):

    return SparseRetriever(lucene_dir, ids, k1=cfg.bm25_k1, b=cfg.bm25_b, rerank_margin=cfg.rerank_margin)


def _sparse_load(e: RetrieverEntry, cfg, corpus, index_dir: Path, manifest: dict, encoder: Any, hint: str):

    if cfg.pad_to:
        log.warning("pad_to=%d ignored: padding only applies to a flat dense retriever", cfg.pad_to)
    try:
        return _sparse_retriever(cfg, index_dir / LUCENE_SUBDIR, corpus.ids)
    except Exception as ex:
        raise CorruptIndexError(f"index at {index_dir} is unreadable ({type(ex).__name__}: {ex}); {hint}") from None


def _sparse_build_slice(e, cfg, full_dir: Path, manifest: dict, sub, lo: int, hi: int, out_dir: Path, progress: bool):

    build_index(e.kind, sub, out_dir, cfg, progress=progress)
    (out_dir / "ids.json").write_text(json.dumps(sub.ids))


def _lucene_ids(lucene_dir: Path, n: int) -> list[str]:
    from pyserini.index.lucene import LuceneIndexReader

    r = LuceneIndexReader(str(lucene_dir))
    return [r.convert_internal_docid_to_collection_docid(i) for i in range(n)]


def _sparse_open_slice(e: RetrieverEntry, cfg, shard_dir: Path, n_docs: int, n_shards: int):
    ids_file = shard_dir / "ids.json"
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else _lucene_ids(shard_dir / LUCENE_SUBDIR, n_docs)
    sparse = _sparse_retriever(cfg, shard_dir / LUCENE_SUBDIR, ids)
    if sparse.scorer.max_doc != n_docs:
        raise ValueError(f"shard at {shard_dir}: Lucene index has {sparse.scorer.max_doc} documents, expected {n_docs}")
    return sparse


def _sparse_router_scorer(router, cfg, encoder: Any):

    return ShardedBM25Scorer(router, cfg.bm25_k1, cfg.bm25_b)


SPARSE = Family(
    name="sparse",
    encodes=False,
    build=_sparse_build,
    index_files=_sparse_files,
    versions=_sparse_versions,
    load=_sparse_load,
    build_slice=_sparse_build_slice,
    open_slice=_sparse_open_slice,
    router_scorer=_sparse_router_scorer,
)


# ---------------------------------------------------------------------------- kinds
def _flat_index(dim: int, cfg) -> Any:
    import faiss

    return faiss.IndexFlatIP(dim)


def _hnsw_index(dim: int, cfg) -> Any:
    import faiss

    hnsw = faiss.IndexHNSWFlat(dim, int(cfg.hnsw_m), faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = int(cfg.hnsw_ef_construction)
    return hnsw


EDR = retrievers.register(
    RetrieverEntry(
        kind="edr",
        family=DENSE,
        exact=True,
        scan=True,
        gpu=True,
        build_order=0,  # first: its build caches the passage vectors that adr's then reuses
        description="exact dense: FAISS flat inner product over the encoder's vectors, re-scored exactly",
        build_params=("encoder",),
        index_params=lambda cfg: {"metric": "inner_product", "faiss_index": "IndexFlatIP"},
        new_index=_flat_index,
    )
)
ADR = retrievers.register(
    RetrieverEntry(
        kind="adr",
        family=DENSE,
        exact=False,
        build_order=2,
        description="approximate dense: FAISS HNSW (inner product) over the encoder's vectors, re-scored exactly",
        build_params=("encoder", "hnsw_m", "hnsw_ef_construction"),
        index_params=lambda cfg: {
            "metric": "inner_product",
            "faiss_index": "IndexHNSWFlat",
            "hnsw_m": cfg.hnsw_m,
            "hnsw_ef_construction": cfg.hnsw_ef_construction,
        },
        new_index=_hnsw_index,
    )
)
SR = retrievers.register(
    RetrieverEntry(
        kind="sr",
        family=SPARSE,
        exact=True,
        build_order=1,
        description="sparse: BM25 over a pyserini Lucene index, re-scored exactly in float64",
        index_params=lambda cfg: {
            "analyzer": "DefaultEnglishAnalyzer",
            "language": "en",
            "stemmer": "porter",
            "stopwords": True,
            "field": "contents",
            "contents": "title + '\\n' + contents",
            "store_positions": True,
            "store_docvectors": True,
            "store_raw": True,
        },
    )
)
