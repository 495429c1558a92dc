"""Passage embeddings, computed once per (corpus, encoder) and shared by every dense index.

Encoding a corpus is the slow part of building a dense index (the demo's 10,359
passages take about 20 minutes with MiniLM on two cores), and the exact (EDR) and
approximate (ADR) indexes, and every shard of either, index the *same* vectors. So the
vectors are looked up, in this order:

1. **the embedding cache**: ``<cache>/<corpus sha256[:16]>-<encoder key>/vectors.npy``
   (float32, as encoded), with a ``manifest.json`` naming the corpus sha256, the
   encoder fingerprint (name and weights hash), the shape and the file's sha256. The
   cache root is ``RALMSPEC_EMBEDDING_CACHE``, else ``~/.cache/ralmspec/embeddings``;
2. **shipped embeddings**: ``assets/embeddings/`` holds the demo corpus' vectors in
   float16 (8 MB instead of 16), listed in ``assets/embeddings/manifest.json`` with the
   same keys and the file's sha256, checked before use, the way pyserini checks its
   prebuilt indexes. They are widened to float32 (exactly: every float16 is a float32)
   and written to the cache;
3. **encoding**, on every core, with a progress bar that shows passages/s and the ETA;
   the result is written to the cache.

A cached or shipped file is used only when its corpus hash *and* encoder fingerprint
match, so vectors of another corpus or other weights are never indexed. A float16
vector differs from the freshly encoded one by at most 2^-11 relative per component
(norms within about 1e-3 of 1); an index built from it is still an exact index *of
those vectors*, and the index manifest records which source it came from
(``manifest["vectors"]``), so every result can be traced to its vectors.

Example::

    vecs, source = passage_vectors(corpus, encoder)   # (n, d) float32
    source["source"]        # 'cache' | 'shipped' | 'encoded'
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ralm import constants as C
from ralm.checksums import sha256_file
from ralm.corpus import Corpus

log = logging.getLogger(__name__)

SHIPPED_DIR = C.ASSETS_DIR / "embeddings"
MANIFEST = "manifest.json"
VECTORS = "vectors.npy"


def embedding_cache_root() -> Path:
    """``RALMSPEC_EMBEDDING_CACHE``, else ``~/.cache/ralmspec/embeddings``."""
    return Path(os.environ.get("RALMSPEC_EMBEDDING_CACHE", str(C.DEFAULT_WORK_DIR / "embeddings"))).expanduser()


def _key(corpus_sha256: str, fingerprint: str) -> str:
    """Directory name of one (corpus, encoder) pair, e.g. ``4502748356b4f4c2-3f1a9c0e2b7d5a41``."""
    return f"{corpus_sha256[:16]}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


def _matches(entry: dict, corpus: Corpus, fingerprint: str, dim: int) -> bool:
    return (
        entry.get("corpus_sha256") == corpus.sha256
        and entry.get("encoder_fingerprint") == fingerprint
        and list(entry.get("shape", [])) == [len(corpus), dim]
    )


def _read_checked(path: Path, entry: dict, what: str) -> np.ndarray | None:
    """The array at ``path`` if its size and sha256 match ``entry``; else ``None`` (logged)."""
    if not path.is_file() or path.stat().st_size != entry.get("bytes"):
        log.warning("%s %s is missing or has the wrong size: ignoring it", what, path)
        return None
    digest = sha256_file(path)
    if digest != entry.get("sha256"):
        log.warning(
            "%s %s has sha256 %s..., expected %s...: ignoring it",
            what,
            path,
            digest[:12],
            str(entry.get("sha256"))[:12],
        )
        return None
    arr = np.load(path, allow_pickle=False)
    if list(arr.shape) != list(entry["shape"]) or arr.dtype != np.dtype(entry.get("dtype", "float32")):
        log.warning("%s %s holds a %s %s array, not the recorded one: ignoring it", what, path, arr.dtype, arr.shape)
        return None
    return arr


def shipped_entries(shipped_dir: Path = SHIPPED_DIR) -> list[dict]:
    """The shipped embedding files listed in ``shipped_dir/manifest.json`` (empty if none)."""
    path = shipped_dir / MANIFEST
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("files", []))


def _from_cache(cache_dir: Path, corpus: Corpus, fingerprint: str, dim: int) -> tuple[np.ndarray, dict] | None:
    d = cache_dir / _key(corpus.sha256, fingerprint)
    try:
        entry = json.loads((d / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not _matches(entry, corpus, fingerprint, dim):
        return None
    arr = _read_checked(d / VECTORS, entry, "cached embeddings")
    return None if arr is None else (arr, entry)


def cache_file(corpus: Corpus, encoder: Any, cache_dir: str | Path | None = None) -> Path | None:
    """The cache's ``vectors.npy`` of ``corpus`` under ``encoder`` (matching manifest and size),
    or None. :func:`passage_vectors` has just read or written it and checked its sha256, so an
    index build can hard-link it instead of writing the same array a second time."""
    d = (Path(cache_dir) if cache_dir is not None else embedding_cache_root()) / _key(
        corpus.sha256, str(encoder.fingerprint)
    )
    try:
        entry = json.loads((d / MANIFEST).read_text())
        size = (d / VECTORS).stat().st_size
    except (OSError, json.JSONDecodeError):
        return None
    ok = bool(corpus.sha256) and _matches(entry, corpus, str(encoder.fingerprint), int(encoder.dim))
    return d / VECTORS if ok and size == entry.get("bytes") else None


def _from_shipped(shipped_dir: Path, corpus: Corpus, fingerprint: str, dim: int) -> tuple[np.ndarray, dict] | None:
    for entry in shipped_entries(shipped_dir):
        if _matches(entry, corpus, fingerprint, dim):
            arr = _read_checked(shipped_dir / entry["file"], entry, "shipped embeddings")
            if arr is not None:
                return arr.astype(np.float32), entry  # float16 -> float32 is exact
    return None


def _save(cache_dir: Path, corpus: Corpus, fingerprint: str, vectors: np.ndarray, source: str) -> Path | None:
    """Write ``vectors`` (float32) to the cache, aside and renamed; ``None`` if the cache is read-only."""
    d = cache_dir / _key(corpus.sha256, fingerprint)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{VECTORS}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.save(fh, vectors)
        os.replace(tmp, d / VECTORS)
        entry = {
            "corpus_sha256": corpus.sha256,
            "corpus_path": corpus.path,
            "encoder_fingerprint": fingerprint,
            "shape": list(vectors.shape),
            "dtype": "float32",
            "bytes": (d / VECTORS).stat().st_size,
            "sha256": sha256_file(d / VECTORS),
            "from": source,
        }
        mtmp = d / f"{MANIFEST}.tmp{os.getpid()}"
        mtmp.write_text(json.dumps(entry, indent=2, sort_keys=True))
        os.replace(mtmp, d / MANIFEST)
        return d / VECTORS
    except OSError as e:
        log.warning("cannot keep passage embeddings in %s (%s); the next index build encodes again", d, e)
        return None


@contextmanager
def _every_core(torch_mod) -> Iterator[None]:
    """Encode on every core (a Ray worker or an engine may have set one thread), then restore."""
    before = torch_mod.get_num_threads()
    torch_mod.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch_mod.set_num_threads(before)


def passage_vectors(
    corpus: Corpus,
    encoder: Any,
    *,
    cache_dir: str | Path | None = None,
    shipped_dir: str | Path | None = None,
    progress: bool = True,
    batch_size: int = 64,
) -> tuple[np.ndarray, dict]:
    """The passage vectors of ``corpus`` under ``encoder``: ``((n, dim) float32, source)``.

    ``source`` says where they came from (``{'source': 'cache'|'shipped'|'encoded', ...}``)
    and is recorded in the index manifest. ``cache_dir``: the embedding cache root
    (default :func:`embedding_cache_root`); ``shipped_dir``: where shipped vectors are
    listed (default ``assets/embeddings``). A corpus without a content hash (built in
    memory) is always encoded. ``encoder`` needs ``fingerprint``, ``dim``
    and, unless the vectors are found, ``encode_passages``.
    """
    cache = Path(cache_dir) if cache_dir is not None else embedding_cache_root()
    fp, dim = str(encoder.fingerprint), int(encoder.dim)
    keyed = bool(corpus.sha256)  # no hash, no key: never cached, never matched
    t0 = time.perf_counter()
    cached = _from_cache(cache, corpus, fp, dim) if keyed else None
    if cached is not None:
        vecs, entry = cached
        log.info("passage embeddings of %d passages from the cache %s", len(corpus), cache)
        info = {"source": "cache", "dtype": "float32", "seconds": round(time.perf_counter() - t0, 3)}
        # how the cached vectors were made ('encoded', 'shipped:...', 'synthesized ...')
        return vecs, info | ({"from": entry["from"]} if "from" in entry else {})
    shipped = _from_shipped(Path(shipped_dir or SHIPPED_DIR), corpus, fp, dim) if keyed else None
    if shipped is not None:
        vecs, entry = shipped
        _save(cache, corpus, fp, vecs, source=f"shipped:{entry['file']}")
        log.info("passage embeddings of %d passages from the shipped %s (float16)", len(corpus), entry["file"])
        return vecs, {
            "source": "shipped",
            "file": entry["file"],
            "dtype": entry.get("dtype", "float16"),
            "sha256": entry["sha256"],
            "seconds": round(time.perf_counter() - t0, 3),
        }
    texts = [corpus.text(i) for i in range(len(corpus))]
    torch_mod = getattr(encoder, "_torch", None)
    if torch_mod is not None:
        with _every_core(torch_mod):
            vecs = encoder.encode_passages(texts, batch_size=batch_size, progress=progress)
    else:
        vecs = encoder.encode_passages(texts, batch_size=batch_size, progress=progress)
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    secs = time.perf_counter() - t0
    if keyed:
        _save(cache, corpus, fp, vecs, source="encoded")
    log.info("encoded %d passages in %.1f s (%.1f passages/s)", len(corpus), secs, len(corpus) / max(secs, 1e-9))
    return vecs, {"source": "encoded", "dtype": "float32", "seconds": round(secs, 3)}


def save_vectors(
    corpus: Corpus, encoder: Any, vectors: np.ndarray, source: str, cache_dir: str | Path | None = None
) -> Path:
    """Put ``vectors`` (``(len(corpus), encoder.dim)``) in the embedding cache as ``corpus``'
    vectors under ``encoder``, recording ``source`` (how they were made): the next index
    build of ``corpus`` uses them instead of encoding, and its manifest says where they came
    from. Used for a padded corpus' synthesized vectors (:mod:`ralm.retrieval.padded_vectors`)."""
    if not corpus.sha256:
        raise ValueError("the corpus has no content hash (load it with Corpus.load or Corpus.from_records)")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.shape != (len(corpus), int(encoder.dim)):
        raise ValueError(f"vectors have shape {vectors.shape}, expected ({len(corpus)}, {int(encoder.dim)})")
    root = Path(cache_dir) if cache_dir is not None else embedding_cache_root()
    path = _save(root, corpus, str(encoder.fingerprint), vectors, source)
    if path is None:
        raise OSError(f"cannot write the embedding cache under {root}")
    return path


def export_shipped(
    corpus: Corpus, encoder: Any, out_dir: str | Path = SHIPPED_DIR, name: str | None = None, **kw: Any
) -> dict:
    """Write ``corpus``' vectors in float16 to ``out_dir`` and list them in its manifest.

    What ``ralmspec assets embeddings`` runs to produce the demo's shipped file. Returns
    the manifest entry.
    """
    if not corpus.sha256:
        raise ValueError("the corpus has no content hash (load it with Corpus.load or Corpus.from_records)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vecs, _ = passage_vectors(corpus, encoder, shipped_dir=out_dir / "__none__", **kw)
    name = (
        name or f"{Path(corpus.path or 'corpus').name.split('.')[0]}-{_key(corpus.sha256, encoder.fingerprint)}.f16.npy"
    )
    path = out_dir / name
    np.save(path, vecs.astype(np.float16))
    entry = {
        "file": name,
        "corpus_sha256": corpus.sha256,
        "encoder_fingerprint": str(encoder.fingerprint),
        "shape": list(vecs.shape),
        "dtype": "float16",
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }
    entries = [e for e in shipped_entries(out_dir) if e.get("file") != name] + [entry]
    (out_dir / MANIFEST).write_text(json.dumps({"files": entries}, indent=2, sort_keys=True) + "\n")
    return entry
