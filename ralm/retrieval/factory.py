"""Loading KB retrievers from validated index directories.

``load_retriever(cfg, corpus, index_dir)`` returns a :class:`~ralm.retrieval.dense.DenseRetriever`
(edr, adr) or :class:`~ralm.retrieval.bm25.SparseRetriever` (sr) after checking the
index's manifest (:func:`~ralm.retrieval.index_build.validate_index`).
``ensure_index`` builds the index first when there is none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.bm25 import SparseRetriever
from ralm.retrieval.dense import DenseRetriever
from ralm.retrieval.errors import CorruptIndexError, IndexNotFoundError
from ralm.retrieval.index_build import (
    DENSE_KINDS,
    KINDS,
    LUCENE_SUBDIR,
    MANIFEST,
    build_hint,
    build_index,
    check_encoder,
    check_kind,
    validate_index,
)
from ralm.retrieval.shared_encoder import get_encoder

log = logging.getLogger(__name__)

__all__ = ["KINDS", "check_kind", "get_encoder", "load_retriever", "ensure_index", "build_index"]


def _resolve_dir(cfg: RetrieverConfig, corpus: Corpus, index_dir: str | Path | None) -> Path:
    d = index_dir if index_dir is not None else cfg.index_dir
    if d is None:
        raise IndexNotFoundError(
            f"no index directory given for the {cfg.kind} retriever; build one with "
            f"`{build_hint(cfg.kind, corpus)}` and pass it as index_dir"
        )
    return Path(d)


def load_retriever(
    cfg: RetrieverConfig,
    corpus: Corpus,
    index_dir: str | Path | None = None,
    *,
    encoder: Any = None,
    checksums: bool = True,
    check_params: bool = True,
):
    """Validate the index at ``index_dir`` (default ``cfg.index_dir``) and load the retriever.

    Raises :class:`~ralm.retrieval.errors.UnknownRetrieverError`, ``IndexNotFoundError``,
    ``CorruptIndexError`` or ``IndexMismatchError`` (all ``ValueError``) with a message
    saying what to do. ``encoder``: a loaded DenseEncoder to reuse (else the shared one
    for ``cfg.encoder``). ``checksums=False`` skips the sha256 of the index files (sizes
    are still checked).
    """
    kind = check_kind(cfg.kind)
    index_dir = _resolve_dir(cfg, corpus, index_dir)
    manifest = validate_index(index_dir, cfg, corpus, checksums=checksums, check_params=check_params)
    hint = f"rebuild it with `{build_hint(kind, corpus, index_dir)}`"
    if kind in DENSE_KINDS:
        import faiss

        enc = encoder if encoder is not None else get_encoder(cfg.encoder)
        check_encoder(manifest, enc, index_dir)
        try:
            vectors = np.load(index_dir / "vectors.npy", allow_pickle=False)
            index = faiss.read_index(str(index_dir / "index.faiss"))
        except Exception as e:
            raise CorruptIndexError(f"index at {index_dir} is unreadable ({type(e).__name__}: {e}); {hint}") from None
        if vectors.shape != (len(corpus), manifest["encoder"]["dim"]) or vectors.dtype != np.float32:
            raise CorruptIndexError(
                f"index at {index_dir}: vectors.npy has shape {vectors.shape} "
                f"{vectors.dtype}, expected ({len(corpus)}, {manifest['encoder']['dim']}) float32; {hint}"
            )
        if int(index.ntotal) != len(corpus):
            raise CorruptIndexError(
                f"index at {index_dir}: index.faiss has {index.ntotal} rows, expected {len(corpus)}; {hint}"
            )
        return DenseRetriever(
            kind,
            enc,
            vectors,
            index,
            hnsw_m=cfg.hnsw_m,
            ef_construction=cfg.hnsw_ef_construction,
            ef_search=cfg.hnsw_ef_search,
            pad_to=cfg.pad_to if kind == "edr" else 0,
            rerank_margin=cfg.rerank_margin,
            faiss_threads=cfg.faiss_threads,
            dense_scan=cfg.dense_scan,
        )

    if cfg.pad_to:
        log.warning("pad_to=%d ignored: padding only applies to the edr retriever", cfg.pad_to)
    try:
        return SparseRetriever(
            index_dir / LUCENE_SUBDIR, corpus.ids, k1=cfg.bm25_k1, b=cfg.bm25_b, rerank_margin=cfg.rerank_margin
        )
    except Exception as e:
        raise CorruptIndexError(f"index at {index_dir} is unreadable ({type(e).__name__}: {e}); {hint}") from None


def ensure_index(
    cfg: RetrieverConfig,
    corpus: Corpus,
    index_dir: str | Path | None = None,
    *,
    progress: bool = True,
    encoder: Any = None,
) -> Path:
    """Build the index at ``index_dir`` if it has no manifest yet; return the directory.

    An existing index is left alone (a mismatched or corrupt one is reported by
    :func:`load_retriever`, never silently rebuilt).
    """
    kind = check_kind(cfg.kind)
    index_dir = _resolve_dir(cfg, corpus, index_dir)
    if not (index_dir / MANIFEST).is_file():
        log.info("no %s index at %s: building it", kind, index_dir)
        build_index(kind, corpus, index_dir, cfg, progress=progress, encoder=encoder)
    return index_dir
