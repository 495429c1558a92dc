"""KNN-LM fixtures: small token datastores of the fixture corpus, built once per session
with a tiny random GPT-2 and with the project's generator (assets/model/pydocs-gpt)."""

from __future__ import annotations

import faiss
import pytest
import torch

from ralm.corpus import Corpus

torch.set_num_threads(1)
faiss.omp_set_num_threads(1)

N_PASSAGES = 30
MAX_PASSAGE_TOKENS = 96
HNSW = dict(hnsw_m=16, hnsw_ef_construction=64)
PROMPTS = [
    "How do I copy a tree of files?",
    "What does the json module do?",
    "Sort a list in ascending order",
    "Command-line parsing library",
    "Return a new list containing all items",
]


@pytest.fixture(scope="session")
def knn_prompts() -> list[str]:
    return list(PROMPTS)


@pytest.fixture(scope="session")
def knn_corpus(fixture_corpus) -> Corpus:
    return Corpus.load(fixture_corpus.path, limit=N_PASSAGES)


@pytest.fixture(scope="session")
def tiny_lm():
    from tests.factories import tiny_engine

    return tiny_engine("gpt2", seed=0)


@pytest.fixture(scope="session")
def tiny_ds(tiny_lm, knn_corpus):
    from ralm.knnlm import build_datastore

    return build_datastore(
        tiny_lm, knn_corpus, max_passage_tokens=MAX_PASSAGE_TOKENS, hnsw=True, progress=False, **HNSW
    )


@pytest.fixture(scope="session")
def project_ds(project_engine, knn_corpus):
    from ralm.knnlm import build_datastore

    return build_datastore(
        project_engine, knn_corpus, max_passage_tokens=MAX_PASSAGE_TOKENS, hnsw=True, progress=False, **HNSW
    )


@pytest.fixture(scope="session")
def knn_setups(tiny_lm, tiny_ds, project_engine, project_ds):
    """name -> (engine, datastore, {index kind: KnnRetriever}); the flat index is padded."""
    from ralm.knnlm import KnnRetriever

    out = {}
    for name, lm, ds in (("tiny-gpt2", tiny_lm, tiny_ds), ("pydocs-gpt", project_engine, project_ds)):
        out[name] = (
            lm,
            ds,
            {"flat": KnnRetriever(ds, "flat", pad_to=3 * len(ds)), "hnsw": KnnRetriever(ds, "hnsw", hnsw_ef_search=32)},
        )
    return out
