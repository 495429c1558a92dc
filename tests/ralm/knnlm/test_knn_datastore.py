"""Datastore build (one entry per token, corpus order, keys = final hidden states),
save/load with its manifest, and clear errors on a mismatch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from ralm.corpus import Corpus
from ralm.knnlm import Datastore, DatastoreError, KnnRetriever, build_datastore


def test_entries_follow_the_corpus(tiny_lm, tiny_ds, knn_corpus):
    ds, tok = tiny_ds, tiny_lm.tokenizer
    limit = ds.manifest["max_passage_tokens"]
    expected = 0
    for row in range(len(knn_corpus)):
        ids = tok(knn_corpus.text(row), add_special_tokens=False)["input_ids"][:limit]
        expected += max(0, len(ids) - 1)
    assert len(ds) == expected == ds.manifest["n_entries"]
    assert np.all(np.diff(ds.passage) >= 0)  # corpus order
    row = 3
    ids = tok(knn_corpus.text(row), add_special_tokens=False)["input_ids"][:limit]
    sel = np.flatnonzero(ds.passage == row)
    assert ds.values[sel].tolist() == ids[1:]  # value = next token, in order
    with torch.inference_mode():
        out = tiny_lm.model(input_ids=torch.tensor([ids[:6]]), output_hidden_states=True)
    np.testing.assert_allclose(ds.keys[sel[4]], out.hidden_states[-1][0, 4].numpy(), rtol=1e-4, atol=1e-5)


def test_save_load_roundtrip_and_mismatches(tmp_path, tiny_lm, tiny_ds, knn_corpus):
    d = tiny_ds.save(tmp_path / "ds")
    man = json.loads((d / "manifest.json").read_text())
    assert man["n_entries"] == len(tiny_ds) and man["has_hnsw"] and man["corpus_sha256"] == knn_corpus.sha256
    back = Datastore.load(d, tiny_lm, knn_corpus)
    assert np.array_equal(back.keys, tiny_ds.keys) and np.array_equal(back.values, tiny_ds.values)
    q = tiny_ds.keys[7] + 0.01
    assert KnnRetriever(back, "hnsw").search(q, 16) == KnnRetriever(tiny_ds, "hnsw").search(q, 16)

    from tests.factories import tiny_engine

    other = tiny_engine("gpt2", seed=1)
    with pytest.raises(DatastoreError, match="another model"):
        Datastore.load(d, other)
    other_corpus = Corpus.load(knn_corpus.path, limit=10)
    with pytest.raises(DatastoreError, match="another corpus"):
        Datastore.load(d, corpus=other_corpus)
    with pytest.raises(DatastoreError, match="manifest.json missing"):
        Datastore.load(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    man["n_entries"] += 1
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(DatastoreError, match="counts disagree"):
        Datastore.load(bad)


def test_build_rejects_empty_corpus(tiny_lm):
    with pytest.raises(DatastoreError, match="no datastore entries"):
        build_datastore(tiny_lm, Corpus.from_records([{"id": "a", "title": "", "contents": ""}]), progress=False)
