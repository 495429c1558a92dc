"""Synthesized vectors for a padded corpus (ralm/retrieval/padded_vectors.py): real rows
kept, generated rows unit-norm mixes around their topic calibrated on really encoded
passages; cached, they build a real HNSW (adr) index whose manifest says where they came
from, and RaLMSpec equals RaLMSeq on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.corpus_padding import write_padded_corpus
from ralm.retrieval.padded_vectors import (
    calibrate_topic_weight,
    mean_topic_cosine,
    mix_vectors,
    padded_corpus_vectors,
)


@pytest.fixture(scope="module")
def real_vectors(index_dirs):
    return np.load(index_dirs["edr"] / "vectors.npy")


def test_mixes_are_unit_vectors_between_topic_and_other(real_vectors):
    rng = np.random.default_rng(0)
    n = len(real_vectors)
    topics, others = rng.integers(n, size=50), rng.integers(n, size=50)
    for c in (0.0, 0.3, 1.0):
        v = mix_vectors(real_vectors, topics, others, c)
        assert v.dtype == np.float32 and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.allclose(mix_vectors(real_vectors, topics, others, 1.0), real_vectors[topics], atol=1e-5)
    cos = [
        mean_topic_cosine(mix_vectors(real_vectors, topics, others, c), real_vectors, topics) for c in (0.2, 0.5, 0.8)
    ]
    assert cos[0] < cos[1] < cos[2]


def test_calibration_hits_the_target_cosine(real_vectors):
    rng = np.random.default_rng(1)
    n = len(real_vectors)
    topics, others = rng.integers(n, size=80), rng.integers(n, size=80)
    lo = mean_topic_cosine(mix_vectors(real_vectors, topics, others, 0.0), real_vectors, topics)
    target = (lo + 1.0) / 2
    c = calibrate_topic_weight(target, real_vectors, topics, others)
    assert 0.0 < c < 1.0
    got = mean_topic_cosine(mix_vectors(real_vectors, topics, others, c), real_vectors, topics)
    assert abs(got - target) < 1e-6


def test_an_adr_index_over_a_padded_corpus_is_exact_and_labelled(
    fixture_corpus, fixture_questions, real_vectors, dense_encoder, project_engine, tmp_path
):
    from ralm.retrieval.factory import build_index, load_retriever
    from ralm.retrieval.passage_vectors import save_vectors
    from tests.factories import padding_hits_with_exact_speculation

    n_real = len(fixture_corpus)
    path = tmp_path / "padded.jsonl"
    topics = write_padded_corpus(fixture_corpus, 5 * n_real, path, progress=False)
    padded = Corpus.load(path)
    vectors, info = padded_corpus_vectors(padded, n_real, topics, real_vectors, dense_encoder, sample=16)
    assert vectors.shape == (5 * n_real, real_vectors.shape[1])
    assert np.array_equal(vectors[:n_real], real_vectors)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert abs(info["mixed_cosine"] - info["encoded_cosine"]) < 0.05  # calibrated on 16, checked on the same
    with pytest.raises(ValueError, match="topics"):
        padded_corpus_vectors(padded, n_real, topics[:-1], real_vectors, dense_encoder)

    cache = tmp_path / "emb"
    save_vectors(padded, dense_encoder, vectors, "synthesized (test)", cache_dir=cache)
    cfg = RetrieverConfig(kind="adr", hnsw_m=16, hnsw_ef_construction=64, hnsw_ef_search=64)
    build_index("adr", padded, tmp_path / "adr", cfg, progress=False, encoder=dense_encoder, vectors_cache=cache)
    manifest = json.loads((tmp_path / "adr" / "manifest.json").read_text())
    assert manifest["vectors"]["source"] == "cache" and manifest["vectors"]["from"] == "synthesized (test)"
    kb = load_retriever(cfg, padded, tmp_path / "adr", encoder=dense_encoder)
    assert padding_hits_with_exact_speculation(kb, padded, n_real, project_engine, fixture_questions[:5]) > 0
