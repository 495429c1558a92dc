"""Passage embeddings: encoded once per (corpus, encoder) and shared by the EDR and ADR
indexes; the shipped float16 demo vectors used, hash-checked, instead of encoding."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from ralm import constants as C
from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.index_build import build_index, validate_index
from ralm.retrieval.passage_vectors import SHIPPED_DIR, export_shipped, passage_vectors, shipped_entries


class CountingEncoder:
    """The real encoder, counting how many passages it was asked to encode."""

    def __init__(self, inner, fingerprint: str | None = None):
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.fingerprint = fingerprint or inner.fingerprint
        self.encoded = 0
        self._torch = inner._torch

    def encode_passages(self, texts, **kw):
        self.encoded += len(texts)
        return self.inner.encode_passages(texts, **kw)


class NoEncoding(CountingEncoder):
    def encode_passages(self, texts, **kw):
        raise AssertionError("the vectors should not have been encoded")


@pytest.fixture
def small_corpus(fixture_corpus) -> Corpus:
    return _records(fixture_corpus, range(40))


def _records(corpus: Corpus, rows) -> Corpus:
    return Corpus.from_records(
        [{"id": corpus.ids[i], "title": corpus.titles[i], "contents": corpus.contents[i]} for i in rows]
    )


def test_edr_and_adr_encode_the_corpus_once(tmp_path, small_corpus, dense_encoder):
    enc = CountingEncoder(dense_encoder)
    cache = tmp_path / "emb"
    m_edr = build_index(
        "edr",
        small_corpus,
        tmp_path / "edr",
        RetrieverConfig(kind="edr"),
        progress=False,
        encoder=enc,
        vectors_cache=cache,
    )
    cfg_adr = RetrieverConfig(kind="adr", hnsw_m=16, hnsw_ef_construction=64)
    m_adr = build_index(
        "adr", small_corpus, tmp_path / "adr", cfg_adr, progress=False, encoder=enc, vectors_cache=cache
    )
    assert enc.encoded == len(small_corpus)
    assert m_edr["vectors"]["source"] == "encoded" and m_adr["vectors"]["source"] == "cache"
    a, b = np.load(tmp_path / "edr" / "vectors.npy"), np.load(tmp_path / "adr" / "vectors.npy")
    assert np.array_equal(a, b)
    # the cache is keyed by the encoder fingerprint: other weights encode again
    other = CountingEncoder(dense_encoder, fingerprint=dense_encoder.fingerprint + "-other")
    _, src = passage_vectors(small_corpus, other, cache_dir=cache, progress=False)
    assert src["source"] == "encoded" and other.encoded == len(small_corpus)
    # ... and by the corpus: a different corpus is not served another's vectors
    shorter = _records(small_corpus, range(len(small_corpus) - 1))
    v, src = passage_vectors(shorter, enc, cache_dir=cache, progress=False)
    assert src["source"] == "encoded" and v.shape == (len(shorter), enc.dim)


def test_a_corpus_without_a_hash_is_never_cached(tmp_path, small_corpus, dense_encoder):
    bare = Corpus(list(small_corpus.ids), list(small_corpus.titles), list(small_corpus.contents))
    enc = CountingEncoder(dense_encoder)
    for _ in range(2):
        _, src = passage_vectors(bare, enc, cache_dir=tmp_path / "emb", progress=False)
        assert src["source"] == "encoded"
    assert enc.encoded == 2 * len(bare) and not (tmp_path / "emb").exists()


def test_corrupt_cache_is_recomputed_not_used(tmp_path, small_corpus, dense_encoder, caplog):
    enc = CountingEncoder(dense_encoder)
    cache = tmp_path / "emb"
    v1, _ = passage_vectors(small_corpus, enc, cache_dir=cache, progress=False)
    (f,) = cache.rglob("vectors.npy")
    data = bytearray(f.read_bytes())
    data[-7] ^= 0xFF  # one vector's bits, size unchanged
    f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        v2, src = passage_vectors(small_corpus, enc, cache_dir=cache, progress=False)
    assert src["source"] == "encoded" and enc.encoded == 2 * len(small_corpus)
    assert "sha256" in caplog.text
    np.testing.assert_allclose(v1, v2, atol=1e-6)
    _, src = passage_vectors(small_corpus, enc, cache_dir=cache, progress=False)
    assert src["source"] == "cache"  # rewritten intact


def test_shipped_float16_vectors_replace_encoding(tmp_path, small_corpus, dense_encoder, caplog):
    shipped = tmp_path / "shipped"
    entry = export_shipped(small_corpus, dense_encoder, shipped, cache_dir=tmp_path / "emb0", progress=False)
    assert entry["dtype"] == "float16" and entry["shape"] == [len(small_corpus), dense_encoder.dim]
    assert shipped_entries(shipped)[0]["sha256"] == entry["sha256"]
    exact, _ = passage_vectors(small_corpus, dense_encoder, cache_dir=tmp_path / "emb0", progress=False)

    enc = NoEncoding(dense_encoder)
    cache = tmp_path / "emb1"
    vecs, src = passage_vectors(small_corpus, enc, cache_dir=cache, shipped_dir=shipped, progress=False)
    assert src["source"] == "shipped" and src["sha256"] == entry["sha256"]
    assert vecs.dtype == np.float32
    assert np.array_equal(vecs, exact.astype(np.float16).astype(np.float32))  # widening is exact
    assert np.abs(vecs - exact).max() <= 2.0**-11  # |v| <= 1: float16's half-ulp
    # now cached: a second call reads the cache
    _, src = passage_vectors(small_corpus, enc, cache_dir=cache, shipped_dir=shipped, progress=False)
    assert src["source"] == "cache"

    # a damaged shipped file is refused (logged) and the corpus is encoded instead
    f = shipped / entry["file"]
    data = bytearray(f.read_bytes())
    data[200] ^= 0x01
    f.write_bytes(bytes(data))
    counting = CountingEncoder(dense_encoder)
    with caplog.at_level(logging.WARNING):
        _, src = passage_vectors(
            small_corpus, counting, cache_dir=tmp_path / "emb2", shipped_dir=shipped, progress=False
        )
    assert src["source"] == "encoded" and counting.encoded == len(small_corpus)
    assert "shipped embeddings" in caplog.text


def test_index_built_from_shipped_vectors_records_its_source(tmp_path, small_corpus, dense_encoder, monkeypatch):
    shipped = tmp_path / "shipped"
    export_shipped(small_corpus, dense_encoder, shipped, cache_dir=tmp_path / "emb0", progress=False)
    from ralm.retrieval import passage_vectors as pv

    monkeypatch.setattr(pv, "SHIPPED_DIR", shipped)  # build_index looks in the default shipped directory
    cfg = RetrieverConfig(kind="edr")
    m = build_index(
        "edr",
        small_corpus,
        tmp_path / "edr",
        cfg,
        progress=False,
        encoder=NoEncoding(dense_encoder),
        vectors_cache=tmp_path / "emb1",
    )
    assert m["vectors"]["source"] == "shipped" and m["vectors"]["dtype"] == "float16"
    validate_index(tmp_path / "edr", cfg, small_corpus)
    saved = json.loads((tmp_path / "edr" / "manifest.json").read_text())
    assert saved["vectors"]["file"] == m["vectors"]["file"]


def test_the_shipped_demo_vectors_are_the_demo_corpus_under_the_default_encoder(dense_encoder):
    """The committed file: intact, keyed to the demo corpus and the default encoder's weights,
    and equal (to float16 precision) to encoding those passages now."""
    from ralm.checksums import sha256_file

    demo = Corpus.load(C.DEMO_CORPUS)
    (entry,) = [e for e in shipped_entries(SHIPPED_DIR) if e["corpus_sha256"] == demo.sha256]
    assert entry["encoder_fingerprint"] == f"{RetrieverConfig().encoder}@sha256:{C.ENCODER_SHA256}"
    assert entry["encoder_fingerprint"] == dense_encoder.fingerprint
    path = SHIPPED_DIR / entry["file"]
    assert sha256_file(path) == entry["sha256"] and path.stat().st_size == entry["bytes"]
    vecs = np.load(path)
    assert vecs.dtype == np.float16 and list(vecs.shape) == [len(demo), dense_encoder.dim]
    rows = [0, 17, 4242, len(demo) - 1]
    fresh = dense_encoder.encode_passages([demo.text(i) for i in rows], progress=False)
    np.testing.assert_allclose(vecs[rows].astype(np.float32), fresh, atol=2e-3)
