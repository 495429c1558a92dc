"""Loading KB retrievers from validated index directories.

``load_retriever(cfg, corpus, index_dir)`` returns the retriever of ``cfg.kind`` (its family's
loader, :mod:`ralm.retrievers`: a :class:`~ralm.retrieval.dense.DenseRetriever` for edr and adr, a
:class:`~ralm.retrieval.bm25.SparseRetriever` for sr) after checking the index's manifest
(:func:`~ralm.retrieval.index_build.validate_index`).
``ensure_index`` builds the index first when there is none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.errors import IndexNotFoundError
from ralm.retrieval.index_build import MANIFEST, build_hint, build_index, validate_index
from ralm.retrieval.shared_encoder import get_encoder
from ralm.retrievers import check_kind, entry, kinds

log = logging.getLogger(__name__)

__all__ = ["kinds", "check_kind", "get_encoder", "load_retriever", "ensure_index", "build_index"]


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
    e = entry(cfg.kind)
    index_dir = _resolve_dir(cfg, corpus, index_dir)
    manifest = validate_index(index_dir, cfg, corpus, checksums=checksums, check_params=check_params)
    hint = f"rebuild it with `{build_hint(e.kind, corpus, index_dir)}`"
    return e.family.load(e, cfg, corpus, index_dir, manifest, encoder, hint)


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
