"""The float16 device scan (``dense_scan: gpu``): candidate sets contain the exact top-k,
the bound holds for every (row, query), results do not depend on the batch, padding is
scanned but never returned, and a device without float32 accumulation is refused.

No GPU is available here: the scan runs its own code on torch's CPU device (the same
operations a CUDA device runs); only the speed, and the CUDA kernels' accumulation (checked
by the probe at start-up there), are not tested here."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.retrieval import device_scan, scan_choice
from ralm.retrieval.dense import DenseRetriever, padding_vectors
from ralm.retrieval.device_scan import DeviceScan
from tests.ralm.retrieval.scan_rows import (
    assert_batch_independent,
    assert_candidates_hold_the_exact_top_k,
    unit_rows,
    with_ties,
)


@pytest.fixture(scope="module")
def scan():
    rng = np.random.default_rng(21)
    X = with_ties(unit_rows(rng, 6000, 64))
    X[200:260] *= np.float32(3.0)  # rows of other norms
    X[300] = 0.0  # a zero row
    X[310, :8] = np.float32(1e-6)  # values in float16's subnormal range
    return X, DeviceScan(X, padding_vectors(30000, 64), pad_rows=30000, device="cpu", block_rows=4096)


@pytest.mark.parametrize("k", [1, 4, 20, 64])
def test_candidates_contain_the_exact_top_k(scan, k):
    X, s = scan
    rng = np.random.default_rng(k)
    for _trial in range(5):
        b = int(rng.integers(1, 17))
        Q = unit_rows(rng, b, 64)
        Q[0] = X[5] + 0.02 * Q[0]  # lands among the planted ties
        if b > 1:
            Q[1] *= np.float32(7.5)
        assert_candidates_hold_the_exact_top_k(s, X, Q, k)


def test_candidates_do_not_depend_on_the_batch_and_stay_small(scan):
    X, s = scan
    Q = unit_rows(np.random.default_rng(3), 16, 64)
    assert_batch_independent(s, X, Q, 10)
    assert max(c.size for c in s.candidates(Q, 10)) < 0.01 * X.shape[0]  # a narrow window, not the index


def test_the_error_bound_holds_for_every_row_and_query():
    """|s^ - s| <= |q| (r_x + g |x~|) with rows and queries of very different norms, in 384
    dims; and s^ is not exact (the bound does work)."""
    import torch

    rng = np.random.default_rng(9)
    d = 384
    X = (rng.standard_normal((3000, d)) * np.exp(rng.standard_normal((3000, 1)))).astype(np.float32)
    Q = (rng.standard_normal((5, d)) * np.exp(rng.standard_normal((5, 1)))).astype(np.float32)
    s = DeviceScan(X, device="cpu")
    est = device_scan._scores(s.data, torch.from_numpy(Q)).double().numpy()  # (3000, 5)
    exact = X.astype(np.float64) @ Q.astype(np.float64).T
    qn = np.linalg.norm(Q.astype(np.float64), axis=1)
    bound = np.outer(s.resid + s.gamma * s.xn, qn)
    err = np.abs(est - exact)
    assert (err <= bound + device_scan.ABS_SLACK).all()
    assert err.max() > 0


def test_the_worked_example():
    x = np.array([[0.1, 0.3]], dtype=np.float32)
    s = DeviceScan(x, device="cpu")
    assert s.resid[0] == pytest.approx(5.46e-5, rel=1e-3)
    assert device_scan.accumulation_gamma(2) == pytest.approx(1.8e-7, rel=1e-2)
    with pytest.raises(ValueError, match="float16's range"):
        DeviceScan(np.array([[1e5, 0.0]], dtype=np.float32), device="cpu")


@pytest.mark.parametrize("how", ["tf32", "fp16-accumulator"])
def test_a_device_without_float32_accumulation_is_refused(monkeypatch, how):
    """Emulated (no such device here): TF32 inputs (10-bit mantissas) and a half-precision
    accumulator each fail the probe, and the scan refuses the device."""
    import torch

    def tf32(rows, queries):
        def cut(t):  # keep 10 mantissa bits
            m, e = torch.frexp(t.float())
            return torch.ldexp(torch.round(m * 2048) / 2048, e)

        return torch.nn.functional.linear(cut(rows), cut(queries))

    def fp16_acc(rows, queries):
        prod = rows.float()[:, None, :] * queries[None, :, :]  # (B, b, d)
        acc = torch.zeros(prod.shape[:2], dtype=torch.float16)
        for i in range(prod.shape[2]):
            acc = (acc.float() + prod[:, :, i]).half()
        return acc.float()

    monkeypatch.setattr(device_scan, "_probes", {})
    monkeypatch.setattr(device_scan, "_scores", tf32 if how == "tf32" else fp16_acc)
    assert device_scan.probe("cpu") is False
    with pytest.raises(RuntimeError, match="does not accumulate in float32"):
        DeviceScan(np.ones((4, 8), dtype=np.float32), device="cpu")


def test_the_retriever_refuses_gpu_without_cuda_and_equals_faiss_on_a_device(monkeypatch):
    import torch

    rng = np.random.default_rng(0)
    X = unit_rows(rng, 3000, 32)
    Q = [X[i] + 0.05 * unit_rows(rng, 1, 32)[0] for i in range(6)]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            DenseRetriever("edr", None, X, dense_scan="gpu")
    monkeypatch.setattr(device_scan, "default_device", lambda: "cpu")  # the device the code runs on here
    gpu = DenseRetriever("edr", None, X, pad_to=20000, dense_scan="gpu")
    faiss = DenseRetriever("edr", None, X, pad_to=20000, dense_scan="faiss")
    assert gpu.dense_scan == "gpu" and gpu.scan_label == "fp16 on cpu" and gpu.n_rows == 20000
    assert scan_choice.choose_plan("gpu", 32).scan == "gpu"
    for batch in ([Q[0]], Q[:2], Q):
        assert gpu.search_vectors(batch, 10) == faiss.search_vectors(batch, 10)


def test_the_first_block_sends_only_entries_that_can_reach_its_floor(scan):
    """The first block's floor is set on the device: of its 4,096 x b scores only the few that
    can still reach the k-th lower bound cross to the host, and the candidates still hold
    the exact top-k."""
    X, s = scan
    Q = unit_rows(np.random.default_rng(11), 16, 64)
    assert_candidates_hold_the_exact_top_k(s, X, Q, 20)
    s.candidates(Q, 20)
    assert s.last_product == "float32"
    assert 16 * 20 <= s.last_transferred < 0.05 * 4096 * 16


def test_tf32_turned_on_after_the_build_is_seen_per_call_and_the_bound_still_holds(scan):
    """The float32 precision is read on every call: with TF32 allowed after the scan was
    built (the legacy and the new torch switches), the call multiplies in float64 and the
    candidates still hold the exact top-k; back to IEEE, back to float32."""
    import torch

    X, s = scan
    Q = unit_rows(np.random.default_rng(12), 8, 64)
    s.candidates(Q, 10)
    assert s.last_product == "float32"
    for switch in ("legacy", "new"):
        if switch == "legacy":
            torch.set_float32_matmul_precision("high")
        else:
            torch.backends.mkldnn.matmul.fp32_precision = "tf32"
        try:
            assert not device_scan.fp32_matmul_ieee("cpu")
            assert_candidates_hold_the_exact_top_k(s, X, Q, 10)
            assert s.last_product == "float64"
        finally:
            if switch == "legacy":
                torch.set_float32_matmul_precision("highest")
            else:
                torch.backends.mkldnn.matmul.fp32_precision = "none"
    assert device_scan.fp32_matmul_ieee("cpu")
    s.candidates(Q, 10)
    assert s.last_product == "float32"


def test_rows_and_padding_are_stored_as_their_round_to_nearest_halves_subnormals_included():
    """The build rounds in torch (numpy's float16 cast is a slow scalar loop on subnormals,
    which norm-0.001 padding is made of): the stored bits must be IEEE round-to-nearest-even,
    the rounding the bound is proven for, ties and subnormals included."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((300, 32)).astype(np.float32)
    rows[0, :6] = [1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 1.5 * 2**-24, 3e-5, -7e-6]  # ties, subnormals
    pad = list(padding_vectors(500, 32, chunk=128))
    scan = DeviceScan(rows, pad, pad_rows=500, device="cpu")
    want = np.concatenate([rows, *pad]).astype(np.float16)
    got = scan.data.numpy()
    assert got.dtype == np.float16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # and the bound factors are those of the stored halves: |x - x~| recomputed from them
    h = want[:300].astype(np.float64)
    resid = np.sqrt(((rows.astype(np.float64) - h) ** 2).sum(axis=1))
    assert np.all(scan.resid >= resid) and np.allclose(scan.resid, resid, rtol=1e-8, atol=0)
