"""Building KB indexes on disk, and validating them before use.

An index directory holds, besides the index itself, a ``manifest.json``: the kind,
the sha256 of the corpus, the encoder fingerprint, every build parameter, library
versions, and the sha256 of every index file. :func:`validate_index` checks all of it
before an index is loaded (see :func:`ralm.retrieval.factory.load_retriever`), so a
stale, foreign or damaged index fails with a clear message instead of silently
returning other documents.

Layout of ``out_dir``:

* edr / adr: ``vectors.npy`` (float32, L2-normalised passage vectors, one row per
  corpus row) and ``index.faiss`` (``IndexFlatIP`` or ``IndexHNSWFlat`` / inner product);
* sr: ``lucene/`` (a pyserini/Anserini Lucene index with positions, document vectors
  and raw documents; its ``contents`` field is ``title + "\\n" + contents``);
* ``manifest.json``, written last: a directory without it is not an index.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ralm.checksums import sha256_file  # noqa: F401  (re-exported for callers)
from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.errors import CorruptIndexError, IndexMismatchError, IndexNotFoundError
from ralm.retrieval.lucene_env import ensure_lucene
from ralm.retrievers import RetrieverEntry, check_kind, entry, kinds

__all__ = ["build_index", "check_kind", "kinds", "validate_index", "read_manifest", "check_encoder", "sha256_file"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LUCENE_SUBDIR = "lucene"


def build_hint(kind: str, corpus: Corpus | None = None, out_dir: str | Path | None = None) -> str:
    parts = [f"ralmspec index --retriever {kind}"]
    if corpus is not None and corpus.path:
        parts.append(f"--corpus {corpus.path}")
    if out_dir is not None:
        parts.append(f"--index-dir {out_dir}")
    return " ".join(parts)


def _versions(e: RetrieverEntry) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in ("ralmspec", "numpy"):
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return {**out, **e.family.versions()}


def _write_json_collection(corpus: Corpus, coll_dir: Path, progress: bool) -> None:
    rows = range(len(corpus))
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="writing JsonCollection", unit="doc", mininterval=1.0)
    with open(coll_dir / "docs.jsonl", "w", encoding="utf-8") as fh:
        for i in rows:
            fh.write(json.dumps({"id": corpus.ids[i], "contents": corpus.text(i)}, ensure_ascii=False) + "\n")


def _quiet_lucene_logs() -> None:
    """Raise Anserini's log4j level to WARN (its indexer logs a page of INFO lines)."""
    try:
        from jnius import autoclass

        Level = autoclass("org.apache.logging.log4j.Level")
        conf = autoclass("org.apache.logging.log4j.core.config.Configurator")
        conf.setRootLevel(Level.WARN)
        conf.setAllLevels("io.anserini", Level.WARN)
    except Exception:  # pragma: no cover - logging only
        pass


def build_lucene(corpus: Corpus, index_dir: Path, threads: int, progress: bool) -> None:
    ensure_lucene()
    from jnius import autoclass

    if index_dir.exists():
        shutil.rmtree(index_dir)
    with tempfile.TemporaryDirectory(prefix="ralmspec-jsoncoll-") as tmp:
        _write_json_collection(corpus, Path(tmp), progress)
        args = [
            "-collection",
            "JsonCollection",
            "-input",
            tmp,
            "-index",
            str(index_dir),
            "-generator",
            "DefaultLuceneDocumentGenerator",
            "-threads",
            str(int(threads)),
            "-storePositions",
            "-storeDocvectors",
            "-storeRaw",
        ]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(corpus), desc="indexing with Lucene", unit="doc")
        if not progress:
            _quiet_lucene_logs()
        autoclass("io.anserini.index.IndexCollection").main(args)
        if bar is not None:
            bar.update(len(corpus))
            bar.close()
    from pyserini.index.lucene import LuceneIndexReader

    n = int(LuceneIndexReader(str(index_dir)).reader.maxDoc())
    if n != len(corpus):
        raise RuntimeError(f"Lucene indexed {n} documents out of {len(corpus)}: duplicate or invalid ids?")


def write_vectors(vectors: np.ndarray, dst: Path, cached: Path | None) -> None:
    """``vectors.npy`` of an index: a hard link to the embedding cache's file when there is
    one on the same file system (the same bytes: both are ``np.save`` of this float32 array),
    else written. A large corpus' vectors then take their disk space once."""
    if cached is not None:
        try:
            os.link(cached, dst)
            return
        except OSError:  # another file system, or links not allowed
            pass
    np.save(dst, vectors)


def build_index(
    kind: str,
    corpus: Corpus,
    out_dir: str | Path,
    cfg: RetrieverConfig | None = None,
    progress: bool = True,
    encoder: Any = None,
    threads: int = 1,
    batch_size: int = 64,
    vectors: np.ndarray | None = None,
    vectors_cache: str | Path | None = None,
) -> dict:
    """Build a ``kind`` index of ``corpus`` into ``out_dir`` and return its manifest.

    ``encoder``: a :class:`~ralm.retrieval.encoder.DenseEncoder` to reuse (dense kinds);
    by default one is loaded from ``cfg.encoder``. ``threads``: Lucene indexing threads
    (1 keeps the document order of the corpus). ``vectors``: passage vectors already
    computed *with this encoder* (e.g. a shard's slice of the full index's vectors); by
    default they come from :func:`~ralm.retrieval.passage_vectors.passage_vectors` (the
    embedding cache at ``vectors_cache``, the shipped demo embeddings, or encoding), so the
    edr and adr indexes of one corpus encode it once.
    """
    e = entry(kind)
    cfg = cfg or RetrieverConfig(kind=kind)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists():
        manifest_path.unlink()  # an interrupted rebuild must not look complete
    t0 = time.time()
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": kind,
        "corpus": {"sha256": corpus.sha256, "n_docs": len(corpus), "path": corpus.path},
        "n_docs": len(corpus),
        "params": e.index_params(cfg),
        "config": cfg.model_dump(mode="json"),
    }
    e.family.build(
        e,
        corpus,
        out_dir,
        cfg,
        manifest,
        progress=progress,
        encoder=encoder,
        threads=threads,
        batch_size=batch_size,
        vectors=vectors,
        vectors_cache=vectors_cache,
    )
    files = e.family.index_files(out_dir)
    manifest["files"] = {
        str(p.relative_to(out_dir)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files
    }
    manifest["versions"] = _versions(e)
    manifest["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest["build_seconds"] = round(time.time() - t0, 3)
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, manifest_path)
    log.info("built %s index of %d passages in %s (%.1fs)", kind, len(corpus), out_dir, manifest["build_seconds"])
    return manifest


# ---------------------------------------------------------------------- validation


def read_manifest(index_dir: str | Path, kind: str, corpus: Corpus | None = None) -> dict:
    """The manifest of ``index_dir``; :class:`IndexNotFoundError` / :class:`CorruptIndexError` if unusable."""
    index_dir = Path(index_dir)
    path = index_dir / MANIFEST
    if not path.is_file():
        what = "directory does not exist" if not index_dir.exists() else "no manifest.json (incomplete build?)"
        raise IndexNotFoundError(
            f"no index at {index_dir} ({what}); build it with `{build_hint(kind, corpus, index_dir)}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptIndexError(
            f"index manifest {path} is unreadable ({e}); rebuild the index with `{build_hint(kind, corpus, index_dir)}`"
        ) from None
    if not isinstance(manifest, dict) or "kind" not in manifest or "files" not in manifest:
        raise CorruptIndexError(
            f"index manifest {path} is not a ralmspec manifest; rebuild the index with "
            f"`{build_hint(kind, corpus, index_dir)}`"
        )
    return manifest


def verify_files(index_dir: str | Path, manifest: dict, checksums: bool = True, corpus: Corpus | None = None) -> None:
    """Check every index file's size (and sha256 unless ``checksums=False``) against the manifest."""
    index_dir = Path(index_dir)
    kind = manifest["kind"]
    hint = f"rebuild it with `{build_hint(kind, corpus, index_dir)}`"
    for rel, info in sorted(manifest["files"].items()):
        p = index_dir / rel
        if not p.is_file():
            raise CorruptIndexError(f"index at {index_dir} is corrupt: file {rel} is missing; {hint}")
        size = p.stat().st_size
        if size != info.get("bytes"):
            raise CorruptIndexError(
                f"index at {index_dir} is corrupt: {rel} has {size} bytes, "
                f"expected {info.get('bytes')} (truncated or modified); {hint}"
            )
        if checksums:
            digest = sha256_file(p)
            if digest != info.get("sha256"):
                raise CorruptIndexError(
                    f"index at {index_dir} is corrupt: checksum mismatch for {rel} "
                    f"(sha256 {digest[:12]}..., expected {str(info.get('sha256'))[:12]}...); {hint}"
                )


def validate_index(
    index_dir: str | Path, cfg: RetrieverConfig, corpus: Corpus, checksums: bool = True, check_params: bool = True
) -> dict:
    """Check that ``index_dir`` is an intact index of ``corpus`` for ``cfg``; return its manifest.

    Checks, in order: kind known, index present, manifest readable, kind, corpus
    (sha256 and size), encoder name (dense), build parameters (adr: HNSW M and
    efConstruction), then the size and sha256 of every file. The encoder's weights
    fingerprint is checked once the encoder is loaded (:func:`check_encoder`).
    """
    e = entry(cfg.kind)
    kind = e.kind
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir, kind, corpus)
    hint = f"rebuild it with `{build_hint(kind, corpus, index_dir)}`"
    if manifest["kind"] != kind:
        raise IndexMismatchError(
            f"index at {index_dir} is a {manifest['kind']!r} index, not {kind!r}: "
            f"point the {kind} retriever at its own index directory, or {hint}"
        )
    c = manifest.get("corpus", {})
    if c.get("sha256") != corpus.sha256 or c.get("n_docs") != len(corpus):
        raise IndexMismatchError(
            f"index at {index_dir} was built from another corpus (sha256 {str(c.get('sha256'))[:12]}..., "
            f"{c.get('n_docs')} passages, {c.get('path') or 'unknown path'}), not this one "
            f"(sha256 {corpus.sha256[:12]}..., {len(corpus)} passages, {corpus.path or 'in memory'}); {hint}"
        )
    if e.family.encodes:
        enc = manifest.get("encoder") or {}
        if enc.get("name") != cfg.encoder:
            raise IndexMismatchError(
                f"index at {index_dir} was built with encoder {enc.get('name')!r}, "
                f"but the retriever is configured with encoder {cfg.encoder!r}; "
                f"use the same encoder or {hint}"
            )
    if check_params:
        for name in e.build_params:
            if name == "encoder":
                continue
            built = manifest.get("params", {}).get(name)
            if built != getattr(cfg, name):
                raise IndexMismatchError(
                    f"index at {index_dir} was built with {name}={built}, but the "
                    f"configuration asks for {name}={getattr(cfg, name)}; {hint}"
                )
    verify_files(index_dir, manifest, checksums=checksums, corpus=corpus)
    return manifest


def check_encoder(manifest: dict, encoder: Any, index_dir: str | Path) -> None:
    """Raise :class:`IndexMismatchError` unless ``encoder`` is the one the index was built with."""
    enc = manifest.get("encoder") or {}
    if enc.get("fingerprint") != encoder.fingerprint:
        raise IndexMismatchError(
            f"index at {index_dir} was built with encoder {enc.get('fingerprint')!r}, but the loaded encoder "
            f"is {encoder.fingerprint!r} (different weights); rebuild the index with "
            f"`{build_hint(manifest['kind'], None, index_dir)}`"
        )
    if enc.get("dim") is not None and int(enc["dim"]) != int(encoder.dim):
        raise IndexMismatchError(
            f"index at {index_dir} has {enc['dim']}-d vectors, the encoder makes {encoder.dim}-d ones"
        )
