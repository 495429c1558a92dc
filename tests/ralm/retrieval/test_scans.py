"""The scan protocol and its registry (:mod:`ralm.retrieval.scans`), and the one built scan of a
dense index that routes each batch by its size (:func:`ralm.retrieval.scan_choice.plan_scan`)."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.retrieval import int8_kernels, scan_choice, scans
from ralm.retrieval.dense import dense_scores
from ralm.retrieval.scan_choice import RoutedScan, ScanPlan


def _rows(n=2000, d=32, seed=0):
    X = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def _exact_top(X, q, k):
    s = dense_scores(X, q)
    return set(np.lexsort((np.arange(len(s)), -s))[:k].tolist())


def test_registry_names_metrics_and_refusals():
    assert set(scans.SCANS) >= {"bf16", "int8", "gpu"}
    assert scans.scans_for("l2") == ("bf16", "int8") and scans.scans_for("ip") == ("bf16", "int8", "gpu")
    with pytest.raises(ValueError, match="unknown scan 'fp8': registered scans are bf16, int8, gpu"):
        scans.make_scan("fp8", _rows())
    with pytest.raises(ValueError, match="the gpu scan ranks by ip, not 'l2'"):
        scans.make_scan("gpu", _rows(), metric="l2")
    assert scans.first_available("faiss", "l2", 32) is None
    with pytest.raises(ValueError, match="ranks by ip"):
        scans.first_available("gpu", "l2", 32)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_every_scan_meets_the_protocol(name):
    if name == "int8" and not int8_kernels.exact_kernels(32):
        pytest.fail("no exact int8 kernel on this machine: the int8 scan cannot be checked")
    X = _rows()
    pad = np.random.default_rng(1).standard_normal((2, 500, 32)).astype(np.float32) * np.float32(1e-3)
    s = scans.make_scan(name, X, list(pad), pad_rows=1000)
    assert isinstance(s, scans.CandidateScan) and s.n_real == 2000 and s.n_rows == 3000 and s.label
    Q = X[:4] + 0.05 * np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    for q, ids in zip(Q, s.candidates(Q, 10)):
        assert ids.max() < 2000 and _exact_top(X, q, 10) <= set(ids.tolist())  # padding never returns


def test_plan_scan_routes_each_batch_size(monkeypatch):
    """A split plan: batch 1 to FAISS (exactly the top-k), larger batches to the int8 scan (a
    superset of it); the retriever re-ranks either exactly."""
    if not int8_kernels.exact_kernels(32):
        pytest.fail("no exact int8 kernel on this machine")
    X = _rows()
    monkeypatch.setattr(scan_choice, "choose_plan", lambda *a, **k: ScanPlan("int8", (1,)))
    r = scan_choice.plan_scan("auto", X, _faiss_flat(X), lambda q, ids: dense_scores(X[ids], q), rerank_margin=4)
    assert isinstance(r, RoutedScan) and r.name == "int8" and r.label.startswith("faiss at 1, int8")
    Q = X[:3] + 0.05 * np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
    one = r.candidates(Q[:1], 5)[0]
    assert set(one.tolist()) == _exact_top(X, Q[0], 5)  # FAISS's stage: the exact top-k itself
    many = r.candidates(Q, 5)
    assert all(_exact_top(X, q, 5) <= set(c.tolist()) for q, c in zip(Q, many))
    with pytest.raises(ValueError, match="do not match the plan"):
        RoutedScan(ScanPlan("int8", (1,)), r.low, None)


def _faiss_flat(X):
    import faiss

    index = faiss.IndexFlatIP(X.shape[1])
    index.add(X)
    return index
