"""The bounded bf16 scan: candidate sets always contain the exact top-k (ip and l2),
the error bound holds, results do not depend on the batch, and an unsound kernel is
refused. These tests force the bf16 path, so they run on any CPU (slowly without bf16
instructions, but correctly)."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.retrieval import bf16_scan
from ralm.retrieval.bf16_scan import Bf16Scan, bound_constant
from ralm.retrieval.dense import DenseRetriever, padding_vectors
from ralm.retrieval.factory import load_retriever
from tests.ralm.retrieval.scan_rows import (
    assert_batch_independent,
    assert_candidates_hold_the_exact_top_k,
    unit_rows,
    with_ties,
)


@pytest.fixture(scope="module")
def ip_scan():
    rng = np.random.default_rng(11)
    X = with_ties(unit_rows(rng, 6000, 64))
    return X, Bf16Scan(X, padding_vectors(40000, 64), pad_rows=40000, block_rows=4096)


@pytest.mark.parametrize("k", [1, 4, 20, 64])
def test_ip_candidates_contain_exact_top_k(ip_scan, k):
    X, scan = ip_scan
    rng = np.random.default_rng(k)
    for _trial in range(6):
        b = int(rng.integers(1, 10))
        Q = unit_rows(rng, b, 64)
        Q[0] = X[5] + 0.02 * Q[0]  # lands among the planted ties
        assert_candidates_hold_the_exact_top_k(scan, X, Q, k)


def test_candidates_do_not_depend_on_the_batch(ip_scan):
    X, scan = ip_scan
    assert_batch_independent(scan, X, unit_rows(np.random.default_rng(3), 9, 64), 10)


def test_candidate_sets_stay_small(ip_scan):
    """The bound is tight enough to be useful: a few dozen rows, not the index."""
    X, scan = ip_scan
    rng = np.random.default_rng(5)
    Q = unit_rows(rng, 8, 64)
    sizes = [c.size for c in scan.candidates(Q, 4)]
    assert max(sizes) < 0.05 * X.shape[0], sizes


@pytest.mark.parametrize("k", [1, 16, 256])
def test_l2_candidates_contain_exact_nearest(k):
    rng = np.random.default_rng(20 + k)
    scale = np.exp(rng.standard_normal((3000, 1))).astype(np.float32)  # varied norms
    Y = (rng.standard_normal((3000, 48)) * scale).astype(np.float32)
    Y[2000:2010] = Y[7]
    scan = Bf16Scan(Y, metric="l2", block_rows=1024)
    Q = (Y[rng.integers(0, 3000, 5)] + 0.3 * rng.standard_normal((5, 48))).astype(np.float32)
    Q[0] = Y[7]
    for i, c in enumerate(scan.candidates(Q, k)):
        dist = ((Y.astype(np.float64) - Q[i].astype(np.float64)) ** 2).sum(1)
        want = np.lexsort((np.arange(3000), dist))[:k]
        got = c[np.lexsort((c, dist[c]))][:k]
        assert np.array_equal(want, got)


def test_error_bound_holds_for_the_kernel():
    """|s^ - s| <= c |q| |x| for every row, with rows of very different norms."""
    import torch

    rng = np.random.default_rng(9)
    d = 384
    X = (rng.standard_normal((4000, d)) * np.exp(2 * rng.standard_normal((4000, 1)))).astype(np.float32)
    Q = rng.standard_normal((4, d)).astype(np.float32)
    est = (
        bf16_scan._scores(torch.from_numpy(X).to(torch.bfloat16), torch.from_numpy(Q).to(torch.bfloat16))
        .double()
        .numpy()
    )  # (n, b)
    exact = X.astype(np.float64) @ Q.astype(np.float64).T
    bound = bound_constant(d) * np.outer(np.linalg.norm(X, axis=1), np.linalg.norm(Q, axis=1))
    err = np.abs(est - exact)
    assert (err <= bound).all()
    assert err.max() > 0  # it is not exact arithmetic: the bound is doing work


def test_unsound_kernel_is_refused(monkeypatch):
    """A kernel accumulating in bf16 breaks the bound: the probe must notice. (The kernel
    is replaced by an emulation here: no real bf16-accumulating CPU is available.)"""
    import torch

    def bf16_accumulating(rows, queries):
        out = torch.zeros(rows.shape[0], queries.shape[0], dtype=torch.bfloat16)
        for i in range(rows.shape[1]):
            out = (out + rows[:, i : i + 1] * queries[:, i][None, :]).to(torch.bfloat16)
        return out.float()

    monkeypatch.setattr(bf16_scan, "_probe_result", None)
    monkeypatch.setattr(bf16_scan, "_scores", bf16_accumulating)
    assert bf16_scan.probe_kernel() is False
    assert bf16_scan.available("auto") is False and bf16_scan.available("faiss") is False
    with pytest.raises(RuntimeError, match="does not accumulate in float32"):
        bf16_scan.available("bf16")
    monkeypatch.setattr(bf16_scan, "_probe_result", None)


def test_probe_accepts_this_machines_kernel():
    assert bf16_scan.probe_kernel() is True


@pytest.mark.parametrize("pad_to", [0, 30000])
def test_edr_bf16_equals_faiss(index_dirs, dense_encoder, retriever_configs, fixture_corpus, sample_queries, pad_to):
    """The whole retriever: bf16 scan and FAISS give the same hits, single and batched."""
    kbs = {
        scan: load_retriever(
            retriever_configs["edr"].model_copy(update={"dense_scan": scan, "pad_to": pad_to}),
            fixture_corpus,
            index_dirs["edr"],
            encoder=dense_encoder,
        )
        for scan in ("faiss", "bf16")
    }
    assert kbs["bf16"].dense_scan == "bf16" and kbs["faiss"].dense_scan == "faiss"
    assert kbs["bf16"].n_rows == kbs["faiss"].n_rows == max(pad_to, len(fixture_corpus))
    queries = sample_queries[:48]
    for k in (1, 4, 20):
        assert kbs["bf16"].batch_search(queries, k) == kbs["faiss"].batch_search(queries, k)
    assert [kbs["bf16"].search(q, 4) for q in queries[:8]] == [kbs["faiss"].search(q, 4) for q in queries[:8]]
    assert kbs["bf16"].search("anything", len(fixture_corpus) + 3) == kbs["faiss"].search(
        "anything", len(fixture_corpus) + 3
    )


def test_bad_scan_name_is_rejected():
    X = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="dense_scan must be"):
        DenseRetriever("edr", None, X, dense_scan="fast")
    from pydantic import ValidationError

    from ralm.config import RetrieverConfig

    with pytest.raises(ValidationError):
        RetrieverConfig(dense_scan="tpu")
