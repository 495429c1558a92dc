"""The bounded int8 scan (CPUs without bf16): candidate sets always contain the exact
top-k, the error bound holds for every (row, query), results do not depend on the batch,
padding is scanned but never returned, and an inexact kernel is refused."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.retrieval import int8_kernels, int8_scan
from ralm.retrieval.dense import DenseRetriever, padding_vectors
from ralm.retrieval.factory import load_retriever
from ralm.retrieval.int8_scan import Int8Scan, quantize
from tests.ralm.retrieval.scan_rows import (
    assert_batch_independent,
    assert_candidates_hold_the_exact_top_k,
    exact_top,
    unit_rows,
    with_ties,
)

HERE = int8_kernels.exact_kernels(64)  # the kernels exact on this machine (both, on x86 with FBGEMM)


@pytest.fixture(scope="module", params=HERE)
def scan(request):
    rng = np.random.default_rng(11)
    X = with_ties(unit_rows(rng, 6000, 64))
    X[200:260] *= np.float32(3.0)  # rows of other norms (and so other scales)
    X[300] = 0.0  # a zero row
    return X, Int8Scan(X, padding_vectors(40000, 64), pad_rows=40000, block_rows=4096, kernel=request.param)


def test_quantize_matches_the_worked_example():
    codes, scale, xn, r = quantize(np.array([[0.5, -0.25]], dtype=np.float32))
    assert codes.tolist() == [[127, -64]]
    assert scale[0] == pytest.approx(0.5 / 127)
    assert r[0] == pytest.approx(abs(-0.25 + 64 * 0.5 / 127), rel=1e-6)
    codes, scale, xn, r = quantize(np.zeros((1, 3), dtype=np.float32))
    assert codes.tolist() == [[0, 0, 0]] and scale[0] == 1.0 and xn[0] == 0 and r[0] == 0


@pytest.mark.parametrize("k", [1, 4, 20, 64])
def test_candidates_contain_the_exact_top_k(scan, k):
    X, s = scan
    rng = np.random.default_rng(k)
    for _trial in range(6):
        b = int(rng.integers(1, 17))
        Q = unit_rows(rng, b, 64)
        Q[0] = X[5] + 0.02 * Q[0]  # lands among the planted ties
        if b > 1:
            Q[1] *= np.float32(7.5)  # a query of another norm
        assert_candidates_hold_the_exact_top_k(s, X, Q, k)


def test_candidates_do_not_depend_on_the_batch(scan):
    X, s = scan
    assert_batch_independent(s, X, unit_rows(np.random.default_rng(3), 16, 64), 10)


def test_candidate_sets_stay_small(scan):
    """The bound is tight enough to be useful: a few dozen rows, not the index."""
    X, s = scan
    sizes = [c.size for c in s.candidates(unit_rows(np.random.default_rng(5), 8, 64), 4)]
    assert max(sizes) < 0.05 * X.shape[0], sizes


@pytest.mark.parametrize("levels", [(127, 127), (63, 63), (127, 63)])
def test_the_error_bound_holds_for_every_row_and_query(levels):
    """|s^ - s| <= |q^| r_x + r_q |x^| + r_q r_x, with rows and queries of very different
    norms and their own code levels, in 384 dims; and s^ is not exact (the bound does work).
    The integer scores are an int64 product: the kernels' own exactness is tested below."""
    rng = np.random.default_rng(9)
    d = 384
    X = (rng.standard_normal((3000, d)) * np.exp(2 * rng.standard_normal((3000, 1)))).astype(np.float32)
    Q = (rng.standard_normal((5, d)) * np.exp(rng.standard_normal((5, 1)))).astype(np.float32)
    xc, xs, xn, xr = quantize(X, levels[0])
    qc, qs, qn, qr = quantize(Q, levels[1])
    n = xc.astype(np.int64) @ qc.astype(np.int64).T
    est = n.astype(np.float64) * xs[:, None] * qs[None, :]
    exact = X.astype(np.float64) @ Q.astype(np.float64).T
    bound = np.outer(xr, qn) + np.outer(xn, qr) + np.outer(xr, qr)
    err = np.abs(est - exact)
    assert (err <= bound + int8_scan.ABS_SLACK).all()
    assert err.max() > 0


@pytest.mark.parametrize("name", HERE)
@pytest.mark.parametrize("d", [2, 64, 384, 1000])
def test_each_kernel_here_is_exact_at_its_levels(name, d):
    """Every kernel the probe accepts gives int64-equal products at its levels on random and
    worst-case codes, at batch sizes the scan uses."""
    import torch

    levels = int8_kernels.exact_levels(name, d)
    if levels is None:  # refused at this width on this machine: never used there
        return
    k = int8_kernels.kernel(name)
    g = torch.Generator().manual_seed(d)
    rows, _ = int8_kernels.worst_case(*levels, d=d)
    for b in (1, 2, 3, 7, 16, 17):
        q = torch.randint(-levels[1], levels[1] + 1, (b, d), dtype=torch.int8, generator=g)
        q[0] = levels[1]
        got = k.scores(k.rows(rows), k.queries(q.numpy()), b)
        assert got.shape == (64, b) and got.dtype == torch.int32
        assert torch.equal(got.long(), rows.long() @ q.long().T)


def test_fbgemm_matches_the_worked_example():
    import torch

    if "fbgemm" not in HERE:  # an ARM build has no FBGEMM: then the kernel must be refused, not used
        assert int8_kernels.exact_levels("fbgemm", 2) is None and int8_kernels.default_kernel(64) != "fbgemm"
        return

    k = int8_kernels.kernel("fbgemm")
    got = k.scores(k.rows(torch.tensor([[127, -64]], dtype=torch.int8)), k.queries(np.array([[63, 1]], np.int8)), 1)
    assert got.tolist() == [[7937]]


def _saturating(self, rows, queries, b):
    """A kernel that accumulates in int16: wrong at every level."""
    import torch

    if isinstance(queries, torch.Tensor) and queries.dtype == torch.float32:  # fbgemm's operand
        q = queries[1 : b + 1].round().long()
        r = torch.ops.quantized.linear_unpack(rows)[0].int_repr().long()
        out = r @ q.T
    else:
        out = rows.long() @ queries.long()[:, :b]
    return out.clamp(-(2**15), 2**15 - 1).int()


def test_an_inexact_kernel_is_refused(monkeypatch):
    """Kernels that accumulate in int16 are wrong at every level: the probe finds no exact
    level, and the scan is refused. (Emulated: no such CPU is available here.)"""
    monkeypatch.setattr(int8_kernels, "_levels", {})
    monkeypatch.setattr(int8_kernels.IntMM, "scores", _saturating)
    monkeypatch.setattr(int8_kernels.Fbgemm, "scores", _saturating)
    assert int8_kernels.exact_kernels(64) == []
    assert int8_scan.available("auto", 64) is False
    with pytest.raises(RuntimeError, match="no int8 matrix product is exact"):
        int8_scan.available("int8", 64)
    with pytest.raises(RuntimeError, match="no int8 kernel"):
        Int8Scan(np.ones((4, 64), dtype=np.float32))
    with pytest.raises(RuntimeError, match="not exact on this machine"):
        Int8Scan(np.ones((4, 64), dtype=np.float32), kernel="int_mm")


def test_a_kernel_missing_from_this_torch_build_is_skipped(monkeypatch):
    """A torch without the quantised ops (an ARM build, or a future release that drops them):
    FBGEMM is reported unavailable, and the scan runs on the other kernel."""

    def missing(self, codes):
        raise AttributeError("no quantized ops in this build")

    monkeypatch.setattr(int8_kernels, "_levels", {})
    monkeypatch.setattr(int8_kernels.Fbgemm, "rows", missing)
    assert int8_kernels.exact_levels("fbgemm", 64) is None
    assert int8_kernels.exact_kernels(64) == ["int_mm"] and int8_kernels.default_kernel(64) == "int_mm"
    s = Int8Scan(unit_rows(np.random.default_rng(2), 300, 64))
    assert s.kernel.name == "int_mm"


def _vpmaddubsw(self, rows, queries_t, b):
    """An AVX2 int8 product without VNNI, as oneDNN computes it: ``rows`` shifted to uint8
    (+128), adjacent u8 x s8 products added in int16 with saturation, then the shift's
    contribution (128 x column sums) taken back out."""
    import torch

    a = rows.long() + 128  # (B, d) uint8 range
    q = queries_t.long()[:, :b]  # (d, b)
    prod = a[:, :, None] * q[None, :, :]  # (B, d, b)
    pairs = (prod[:, 0::2] + prod[:, 1::2]).clamp(-(2**15), 2**15 - 1)  # (B, d/2, b) int16 sums
    return (pairs.sum(dim=1) - 128 * q.sum(dim=0)[None, :]).to(torch.int32)


def test_a_pair_saturating_kernel_gets_the_coarser_level_and_stays_exact(monkeypatch):
    """On an AVX2-only CPU, codes in [-127, 127] saturate oneDNN's pair sums; the probe must
    fall back to [-63, 63], and the scan at that level still contains the exact top-k.
    (The kernel is emulated; with ONEDNN_MAX_CPU_ISA=AVX2 the real one does the same.)"""
    monkeypatch.setattr(int8_kernels, "_levels", {})
    monkeypatch.setattr(int8_kernels.IntMM, "scores", _vpmaddubsw)
    a, q = int8_kernels.worst_case(127, 127, d=32)
    assert not bool((_vpmaddubsw(None, a, q.T, 16).long() == a.long() @ q.long().T).all())  # it saturates
    assert int8_kernels.exact_levels("int_mm", 32) == (63, 63)
    rng = np.random.default_rng(4)
    X = with_ties(unit_rows(rng, 1200, 32))
    s = Int8Scan(X, padding_vectors(800, 32), pad_rows=800, block_rows=512, kernel="int_mm")
    assert s.qmax == s.query_qmax == 63 and s.label == "int8 +-63 int_mm"
    for k in (1, 4, 20):
        Q = unit_rows(rng, 9, 32)
        Q[0] = X[5] + 0.02 * Q[0]
        for j, cand in enumerate(s.candidates(Q, k)):
            top = {d for d, _ in exact_top(X, Q[j], k)}
            assert top <= set(cand.tolist())


def test_probe_accepts_this_machines_kernel():
    from ralm.retrieval import bf16_scan

    assert HERE, "no exact int8 kernel on this machine"
    assert int8_kernels.default_kernel(64) == HERE[0]
    assert int8_scan.available("int8", 64) is True and int8_scan.available("faiss", 64) is False
    assert bf16_scan.available("int8") is False
    with pytest.raises(ValueError, match="unknown int8 kernel"):
        int8_kernels.kernel("vnni")


@pytest.mark.parametrize("pad_to", [0, 30000])
def test_edr_int8_equals_faiss(index_dirs, dense_encoder, retriever_configs, fixture_corpus, sample_queries, pad_to):
    """The whole retriever on the fixture corpus: int8 scan (each kernel here) and FAISS
    give the same hits, single and batched."""
    kbs = {
        scan: load_retriever(
            retriever_configs["edr"].model_copy(update={"dense_scan": scan, "pad_to": pad_to}),
            fixture_corpus,
            index_dirs["edr"],
            encoder=dense_encoder,
        )
        for scan in ("faiss", "int8")
    }
    assert kbs["int8"].dense_scan == "int8" and kbs["faiss"].dense_scan == "faiss"
    for name in HERE[1:]:  # the loader built the first; the others directly
        other = DenseRetriever(
            "edr", dense_encoder, kbs["faiss"].scorer.vectors, pad_to=pad_to, dense_scan="int8", int8_kernel=name
        )
        assert other.scan.low.kernel.name == name
        assert other.batch_search(sample_queries[:48], 4) == kbs["faiss"].batch_search(sample_queries[:48], 4)
    assert kbs["int8"].n_rows == kbs["faiss"].n_rows == max(pad_to, len(fixture_corpus))
    queries = sample_queries[:48]
    for k in (1, 4, 20):
        assert kbs["int8"].batch_search(queries, k) == kbs["faiss"].batch_search(queries, k)
    assert [kbs["int8"].search(q, 4) for q in queries[:8]] == [kbs["faiss"].search(q, 4) for q in queries[:8]]


def test_padded_query_columns_change_no_candidate(scan, monkeypatch):
    """A batch multiplied at a wider ``int_mm`` width (zero query columns, int8_widths) gets
    exactly the candidate sets it gets at its own width, for every batch size."""
    X, _ = scan
    s = Int8Scan(X, padding_vectors(40000, 64), pad_rows=40000, block_rows=4096, kernel="int_mm")
    Q = unit_rows(np.random.default_rng(5), 13, 64)
    own = {b: s.candidates(Q[:b], 10) for b in (2, 3, 7, 13)}
    monkeypatch.setattr(int8_kernels, "padded_width", lambda b, dim: 64 if b > 1 else b)
    for b, cands in own.items():
        wide = s.candidates(Q[:b], 10)
        assert len(wide) == b and all(np.array_equal(x, y) for x, y in zip(wide, cands))


def test_batch_widths_take_the_cheapest_width_at_or_above_and_prefer_the_smallest():
    from ralm.retrieval.int8_widths import choose_widths, padded_width, width_table

    # the 32,768-row costs of the module docstring (ms): powers of two cost about the same
    cost = {1: 0.21, 2: 1.34, 3: 2.15, 4: 1.28, 7: 3.08, 8: 1.31, 9: 2.25, 12: 2.20, 15: 4.15, 16: 1.36}
    table = choose_widths(cost)
    assert table[3] == 4 and table[5] == 8 and table[9] == 16 and table[15] == 16
    assert table[1] == 1 and table[2] == 2 and table[16] == 16
    # a kernel whose cost grows with the width: no padding
    assert choose_widths({w: float(w) for w in range(1, 9)}) == (0, 1, 2, 3, 4, 5, 6, 7, 8)
    measured = width_table(64)  # this machine's, probed once per process
    assert len(measured) == 65 and all(b <= measured[b] <= 64 for b in range(1, 65))
    assert padded_width(1, 64) == 1 and padded_width(65, 64) == 96 and padded_width(100, 64) == 128


def test_concurrent_batches_on_one_scan_get_the_serial_answers(scan):
    """The served verifier may run several searches on one shard at once (threads): the
    kernels' packed rows are shared read-only, so each thread gets the candidates it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    X, s = scan
    rng = np.random.default_rng(8)
    batches = [unit_rows(rng, int(b), 64) for b in (1, 3, 16, 7, 2, 16, 5, 1)]
    serial = [s.candidates(Q, 10) for Q in batches]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda Q: s.candidates(Q, 10), batches))
    for a, b in zip(serial, together):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kernel", HERE)
@pytest.mark.parametrize("k", [1, 16, 256])
def test_l2_candidates_contain_the_exact_nearest_rows(kernel, k):
    """Squared distance (KNN-LM's metric): rows of varied norms (and so of varied |x|^2 inside
    a block), duplicates at the boundary, far padding scanned and never returned, any batch."""
    rng = np.random.default_rng(30 + k)
    scale = np.exp(rng.standard_normal((5000, 1))).astype(np.float32)
    Y = (rng.standard_normal((5000, 48)) * scale * 4).astype(np.float32)
    Y[2000:2010] = Y[7]
    far = padding_vectors(20000, 48, norm=1e4)
    scan = Int8Scan(Y, far, pad_rows=20000, block_rows=1024, kernel=kernel, metric="l2")
    Q = (Y[rng.integers(0, 5000, 6)] + 0.3 * rng.standard_normal((6, 48))).astype(np.float32)
    Q[0] = Y[7]
    dist = lambda q: ((Y.astype(np.float64) - q.astype(np.float64)) ** 2).sum(1)  # noqa: E731
    together = scan.candidates(Q, k)
    for i, c in enumerate(together):
        d = dist(Q[i])
        want = np.lexsort((np.arange(5000), d))[:k]
        got = c[np.lexsort((c, d[c]))][:k]
        assert np.array_equal(want, got) and (c < 5000).all()
        alone = scan.candidates(Q[i : i + 1], k)[0]
        assert np.array_equal(alone[np.lexsort((alone, d[alone]))][:k], want)
    assert max(c.size for c in together) < 0.2 * 5000 + k  # a candidate window, not the whole KB


def test_an_unknown_metric_is_refused():
    with pytest.raises(ValueError, match="metric must be 'ip' or 'l2'"):
        Int8Scan(np.ones((4, 8), dtype=np.float32), metric="cosine")
