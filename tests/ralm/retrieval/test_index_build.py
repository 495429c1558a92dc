"""Index building, manifests, and the clear errors for unusable indexes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.errors import CorruptIndexError, IndexMismatchError, IndexNotFoundError, UnknownRetrieverError
from ralm.retrieval.factory import ensure_index, load_retriever
from ralm.retrieval.index_build import build_index, check_kind, sha256_file


def _copy(index_dirs, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(index_dirs[kind], dst)
    return dst


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["edr", "adr", "sr"])
def test_manifest_written(kind, index_dirs, fixture_corpus, dense_encoder):
    d = index_dirs[kind]
    m = json.loads((d / "manifest.json").read_text())
    assert m["kind"] == kind and m["n_docs"] == len(fixture_corpus)
    assert m["corpus"]["sha256"] == fixture_corpus.sha256
    assert m["created"] and m["versions"]["numpy"]
    assert m["files"]
    for rel, info in m["files"].items():
        assert sha256_file(d / rel) == info["sha256"] and (d / rel).stat().st_size == info["bytes"]
    if kind == "sr":
        assert m["encoder"] is None and "pyserini" in m["versions"] and "lucene" in m["versions"]
        assert any(rel.startswith("lucene/") for rel in m["files"])
        assert m["params"]["store_docvectors"] is True
    else:
        assert m["encoder"]["fingerprint"] == dense_encoder.fingerprint
        assert "sha256:" in m["encoder"]["fingerprint"] and m["encoder"]["dim"] == 384
        assert set(m["files"]) == {"vectors.npy", "index.faiss"}
        v = np.load(d / "vectors.npy")
        assert v.dtype == np.float32 and v.shape == (len(fixture_corpus), 384)
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    if kind == "adr":
        assert m["params"]["hnsw_m"] == 16 and m["params"]["hnsw_ef_construction"] == 64


def test_unknown_retriever(fixture_corpus, index_dirs, tmp_path):
    msg = "unknown retriever 'xyz': choose one of edr, adr, sr"
    with pytest.raises(UnknownRetrieverError, match=msg):
        check_kind("xyz")
    cfg = RetrieverConfig().model_copy(update={"kind": "xyz"})
    with pytest.raises(UnknownRetrieverError, match=msg):
        load_retriever(cfg, fixture_corpus, index_dirs["edr"])
    with pytest.raises(UnknownRetrieverError, match=msg):
        build_index("xyz", fixture_corpus, tmp_path / "x")
    assert issubclass(UnknownRetrieverError, ValueError)


@pytest.mark.parametrize("kind", ["edr", "sr"])
def test_missing_index(kind, fixture_corpus, tmp_path):
    cfg = RetrieverConfig(kind=kind)
    with pytest.raises(
        IndexNotFoundError, match=rf"no index at .*nowhere.*build it with `ralmspec index --retriever {kind}"
    ):
        load_retriever(cfg, fixture_corpus, tmp_path / "nowhere")
    (tmp_path / "half").mkdir()  # a directory without manifest: an interrupted build
    with pytest.raises(IndexNotFoundError, match="no manifest.json"):
        load_retriever(cfg, fixture_corpus, tmp_path / "half")
    with pytest.raises(IndexNotFoundError, match="no index directory given"):
        load_retriever(cfg, fixture_corpus)


def test_corrupt_dense_index(index_dirs, fixture_corpus, dense_encoder, retriever_configs, tmp_path):
    cfg = retriever_configs["edr"]
    d = _copy(index_dirs, "edr", tmp_path)
    _flip_byte(d / "index.faiss", 100)
    with pytest.raises(
        CorruptIndexError,
        match=r"corrupt: checksum mismatch for index.faiss.*rebuild it with `ralmspec index --retriever edr",
    ):
        load_retriever(cfg, fixture_corpus, d, encoder=dense_encoder)

    d2 = _copy(index_dirs, "edr", tmp_path / "t")
    with open(d2 / "vectors.npy", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(CorruptIndexError, match=r"vectors.npy has 1000 bytes, expected \d+ \(truncated or modified\)"):
        load_retriever(cfg, fixture_corpus, d2, encoder=dense_encoder)

    d3 = _copy(index_dirs, "adr", tmp_path / "h")
    _flip_byte(d3 / "index.faiss", 0)  # damage the FAISS header, skip checksums: unreadable
    with pytest.raises(CorruptIndexError, match=r"index at .* is unreadable"):
        load_retriever(retriever_configs["adr"], fixture_corpus, d3, encoder=dense_encoder, checksums=False)

    d4 = _copy(index_dirs, "edr", tmp_path / "m")
    (d4 / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptIndexError, match="manifest .* is unreadable"):
        load_retriever(cfg, fixture_corpus, d4, encoder=dense_encoder)

    d5 = _copy(index_dirs, "edr", tmp_path / "r")
    (d5 / "index.faiss").unlink()
    with pytest.raises(CorruptIndexError, match="file index.faiss is missing"):
        load_retriever(cfg, fixture_corpus, d5, encoder=dense_encoder)


def test_corrupt_lucene_index(index_dirs, fixture_corpus, retriever_configs, tmp_path):
    d = _copy(index_dirs, "sr", tmp_path)
    victim = max((p for p in (d / "lucene").iterdir() if p.name != "write.lock"), key=lambda p: p.stat().st_size)
    _flip_byte(victim, victim.stat().st_size // 2)
    with pytest.raises(CorruptIndexError, match=rf"checksum mismatch for lucene/{victim.name}.*--retriever sr"):
        load_retriever(retriever_configs["sr"], fixture_corpus, d)


@pytest.mark.parametrize("kind", ["edr", "adr", "sr"])
def test_corpus_mismatch(kind, index_dirs, fixture_corpus, dense_encoder, retriever_configs):
    records = [
        {"id": i, "title": t, "contents": c}
        for i, t, c in zip(fixture_corpus.ids, fixture_corpus.titles, fixture_corpus.contents)
    ]
    records[7]["contents"] += " (edited)"
    other = Corpus.from_records(records)
    with pytest.raises(
        IndexMismatchError, match=rf"was built from another corpus .*{len(fixture_corpus)} passages.*rebuild it with"
    ):
        load_retriever(retriever_configs[kind], other, index_dirs[kind], encoder=dense_encoder)
    with pytest.raises(IndexMismatchError, match="another corpus"):
        load_retriever(
            retriever_configs[kind], Corpus.from_records(records[:50]), index_dirs[kind], encoder=dense_encoder
        )


def test_encoder_mismatch(index_dirs, fixture_corpus, dense_encoder, retriever_configs, tmp_path):
    cfg = retriever_configs["edr"].model_copy(update={"encoder": "sentence-transformers/all-mpnet-base-v2"})
    with pytest.raises(
        IndexMismatchError,
        match=r"built with encoder 'local:all-MiniLM-L6-v2', but the retriever is "
        r"configured with encoder 'sentence-transformers/all-mpnet-base-v2'",
    ):
        load_retriever(cfg, fixture_corpus, index_dirs["edr"])
    # same name, other weights (fingerprint)
    d = _copy(index_dirs, "adr", tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["encoder"]["fingerprint"] = "local:all-MiniLM-L6-v2@sha256:" + "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexMismatchError, match=r"loaded encoder is .* \(different weights\)"):
        load_retriever(retriever_configs["adr"], fixture_corpus, d, encoder=dense_encoder)


def test_kind_mismatch(index_dirs, fixture_corpus, dense_encoder, retriever_configs):
    with pytest.raises(IndexMismatchError, match=r"index at .* is a 'edr' index, not 'adr'"):
        load_retriever(retriever_configs["adr"], fixture_corpus, index_dirs["edr"], encoder=dense_encoder)
    with pytest.raises(IndexMismatchError, match=r"is a 'sr' index, not 'edr'"):
        load_retriever(retriever_configs["edr"], fixture_corpus, index_dirs["sr"], encoder=dense_encoder)


def test_build_parameter_mismatch(index_dirs, fixture_corpus, dense_encoder, retriever_configs):
    cfg = retriever_configs["adr"].model_copy(update={"hnsw_m": 32})
    with pytest.raises(IndexMismatchError, match="built with hnsw_m=16, but the configuration asks for hnsw_m=32"):
        load_retriever(cfg, fixture_corpus, index_dirs["adr"], encoder=dense_encoder)
    r = load_retriever(cfg, fixture_corpus, index_dirs["adr"], encoder=dense_encoder, check_params=False)
    assert r.name == "adr"
    # search-time parameters may differ freely
    cfg2 = retriever_configs["adr"].model_copy(update={"hnsw_ef_search": 200, "rerank_margin": 4})
    assert load_retriever(cfg2, fixture_corpus, index_dirs["adr"], encoder=dense_encoder).ef_search == 200


@pytest.mark.parametrize("kind", ["edr", "sr"])
def test_ensure_index_builds_once(kind, fixture_corpus, dense_encoder, tmp_path):
    records = [
        {"id": i, "title": t, "contents": c}
        for i, t, c in zip(fixture_corpus.ids[:20], fixture_corpus.titles[:20], fixture_corpus.contents[:20])
    ]
    small = Corpus.from_records(records)
    cfg = RetrieverConfig(kind=kind)
    d = ensure_index(cfg, small, tmp_path / kind, progress=False, encoder=dense_encoder)
    stamp = (d / "manifest.json").stat().st_mtime_ns
    assert ensure_index(cfg, small, d, progress=False, encoder=dense_encoder) == d
    assert (d / "manifest.json").stat().st_mtime_ns == stamp  # not rebuilt
    r = load_retriever(cfg, small, d, encoder=dense_encoder)
    hits = r.search(small.contents[3][:200], 3)
    assert len(hits) == 3 and hits[0][0] == 3
