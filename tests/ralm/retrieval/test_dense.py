"""EDR (flat) and ADR (HNSW): exact re-scoring, ordering, batch independence, padding."""

from __future__ import annotations

import logging

import faiss
import numpy as np
import pytest

from ralm import constants as C
from ralm.retrieval.base import rank_hits
from ralm.retrieval.dense import DenseRetriever, dense_score_fn, dense_scores
from ralm.retrieval.factory import load_retriever

DENSE = ["edr", "adr"]


def _ordered(hits):
    return all((-a[1], a[0]) < (-b[1], b[0]) for a, b in zip(hits, hits[1:]))


class StubEncoder:
    """Encoder double for synthetic vectors: 'q<i>' -> the i-th query vector."""

    def __init__(self, Q):
        self.Q = np.asarray(Q, dtype=np.float32)
        self.fingerprint = "stub"

    def encode_queries(self, texts):
        return [self.Q[int(t[1:])] for t in texts]


@pytest.mark.parametrize("kind", DENSE)
def test_hits_are_ordered_and_exact(kind, retrievers, sample_queries):
    r = retrievers[kind]
    assert r.name == kind
    for q in sample_queries[:60]:
        hits = r.search(q, 10)
        assert len(hits) == 10
        assert _ordered(hits)
        rep = r.scorer.encode([q])[0]
        ids = [d for d, _ in hits]
        assert [s for _, s in hits] == list(r.scorer.score(rep, r.scorer.doc_keys(ids)))


@pytest.mark.parametrize("kind", DENSE)
def test_search_equals_batch_search_of_64(kind, retrievers, sample_queries):
    r = retrievers[kind]
    batch = sample_queries[:64]
    together = r.batch_search(batch, 10)  # FAISS's batched kernel (>= 20 queries)
    alone = [r.search(q, 10) for q in batch]
    assert together == alone
    # and inside a different batch
    mixed = r.batch_search(sample_queries[100:164] + batch[:5], 10)[-5:]
    assert mixed == alone[:5]


def test_edr_equals_brute_force(retrievers, sample_queries):
    r = retrievers["edr"]
    V = r.scorer.vectors
    all_ids = np.arange(len(V))
    for q in sample_queries[:100] + sample_queries[200:]:
        rep = r.scorer.encode([q])[0]
        exact = dense_scores(V, rep)
        assert r.search(q, 10) == rank_hits(all_ids, exact, 10)
        # plain numpy float64 matmul gives the same ranking up to rounding
        blas = V.astype(np.float64) @ rep.astype(np.float64)
        np.testing.assert_allclose(exact, blas, rtol=0, atol=1e-12)
        top_blas = np.argsort(-blas, kind="stable")[:10]
        top_exact = [d for d, _ in r.search(q, 10)]
        gaps = np.diff(np.sort(blas)[::-1][:11])
        if np.all(np.abs(gaps) > 1e-9):
            assert list(top_blas) == top_exact


def test_adr_with_large_ef_agrees_with_edr(retrievers, index_dirs, dense_encoder, sample_queries):
    edr = retrievers["edr"]
    index = faiss.read_index(str(index_dirs["adr"] / "index.faiss"))
    adr = DenseRetriever("adr", dense_encoder, edr.scorer.vectors, index, ef_search=256)
    queries = sample_queries[:120]
    a = adr.batch_search(queries, 10)
    e = edr.batch_search(queries, 10)
    top1 = np.mean([x[0] == y[0] for x, y in zip(a, e)])
    top10 = np.mean([x == y for x, y in zip(a, e)])
    assert top1 >= 0.95 and top10 >= 0.8, (top1, top10)


def test_dense_scores_do_not_depend_on_layout():
    rng = np.random.default_rng(0)
    V = rng.standard_normal((257, 384)).astype(np.float32)
    q = rng.standard_normal(384).astype(np.float32)
    full = dense_scores(V, q)
    assert full.dtype == np.float64
    alone = np.array([dense_scores(V[i], q)[0] for i in range(len(V))])
    listed = dense_scores(list(V[::-1]), q)[::-1]
    as64 = dense_scores(V.astype(np.float64), q.astype(np.float64))
    fortran = dense_scores(np.asfortranarray(V), q)
    for other in (alone, listed, as64, fortran):
        assert np.array_equal(full, other)  # bit for bit
    assert np.array_equal(dense_score_fn(q, V), full)
    np.testing.assert_allclose(full, V.astype(np.float64) @ q.astype(np.float64), rtol=1e-12, atol=1e-12)
    # odd dimensions are zero-padded to a power of two
    np.testing.assert_allclose(dense_scores(V[:, :7], q[:7]), V[:, :7].astype(np.float64) @ q[:7], atol=1e-12)


@pytest.mark.parametrize("kind,scan", [("edr", "faiss"), ("edr", "bf16"), ("adr", "auto")])
def test_ties_break_by_doc_id_with_boundary_expansion(kind, scan):
    """A group of 40 identical vectors straddles the top-k boundary: the candidate set must
    grow until the lowest ids of the group are in, whatever FAISS returns first."""
    rng = np.random.default_rng(7)
    dim = 32
    V = rng.standard_normal((400, dim)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    dup = V[0].copy()
    tied = np.sort(rng.choice(np.arange(1, 400), size=40, replace=False))
    V[tied] = dup
    q = (dup + 0.05 * rng.standard_normal(dim)).astype(np.float32)
    q /= np.linalg.norm(q)
    r = DenseRetriever(
        kind, StubEncoder([q]), V, hnsw_m=16, ef_construction=200, ef_search=400, rerank_margin=2, dense_scan=scan
    )
    hits = r.search("q0", 10)
    exact = dense_scores(V, q)
    assert hits == rank_hits(np.arange(400), exact, 10)
    group = sorted([0, *tied])
    assert [d for d, _ in hits] == group[:10]  # the whole top-10 is tied: lowest ids win
    assert len({s for _, s in hits}) == 1
    if scan == "bf16":  # the bounded scan takes every row the bound cannot exclude
        assert r.stats["candidates"] >= 41
    else:
        assert r.stats["expansions"] >= 1


def test_k_larger_than_corpus_returns_everything(retrievers, fixture_corpus):
    r = retrievers["edr"]
    hits = r.search("python module", len(fixture_corpus) + 5)
    assert len(hits) == len(fixture_corpus)
    assert sorted(d for d, _ in hits) == list(range(len(fixture_corpus)))
    assert _ordered(hits)


def test_padding_gives_identical_results(
    retrievers, index_dirs, dense_encoder, retriever_configs, fixture_corpus, sample_queries, caplog
):
    edr = retrievers["edr"]
    cfg = retriever_configs["edr"].model_copy(update={"pad_to": 20000, "dense_scan": "faiss"})
    with caplog.at_level(logging.WARNING):
        padded = load_retriever(cfg, fixture_corpus, index_dirs["edr"], encoder=dense_encoder)
    assert padded.padded_rows == 20000 and padded.index.ntotal == 20000
    assert edr.padded_rows == 0
    assert "EDR index padded to 20000 rows to emulate" in caplog.text
    queries = sample_queries[:64]
    assert padded.batch_search(queries, 10) == edr.batch_search(queries, 10)
    assert [padded.search(q, 3) for q in queries[:10]] == [edr.search(q, 3) for q in queries[:10]]
    # padding rows are tiny: they never reach the top of a real query
    D, I = padded.index.search(np.stack(dense_encoder.encode_queries(queries[:5])), 50)
    assert (I[:, :10] < len(fixture_corpus)).all()
    pad = padded.index.reconstruct(len(fixture_corpus) + 3)
    assert abs(np.linalg.norm(pad) - C.PAD_VECTOR_NORM) < 1e-9


def test_padding_rows_dropped_even_when_they_outrank_real_ones():
    """Real vectors with negative scores rank below the padding: padding must never be
    returned, and the search must widen until it has k real documents."""
    rng = np.random.default_rng(3)
    V = rng.standard_normal((30, 16)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    q = -V.mean(axis=0)
    q = (q / np.linalg.norm(q)).astype(np.float32)
    for scan in ("faiss", "bf16", "int8"):
        plain = DenseRetriever("edr", StubEncoder([q]), V, rerank_margin=1, dense_scan=scan)
        padded = DenseRetriever("edr", StubEncoder([q]), V, pad_to=5000, rerank_margin=1, dense_scan=scan)
        assert padded.search("q0", 30) == plain.search("q0", 30) == rank_hits(np.arange(30), dense_scores(V, q), 30)


def test_adr_with_k_beyond_what_hnsw_returns():
    """HNSW returns fewer rows than asked for very large k: the result is still k hits,
    ranked exactly."""
    rng = np.random.default_rng(5)
    V = rng.standard_normal((500, 16)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    r = DenseRetriever("adr", StubEncoder(V[:1]), V, hnsw_m=16, ef_construction=32, ef_search=8)
    hits = r.search("q0", 400)
    assert hits == rank_hits(np.arange(500), dense_scores(V, V[0]), 400)
