"""How ``auto`` answers each batch size: it times every path that runs exactly here (FAISS,
and the bf16 / int8 scans where usable) at batch 1 and the verification sizes, builds the
cheaper low-precision scan and routes each size to whichever of it and FAISS is faster
there; forced modes use one path and never fall back. Timings are injected (these CPUs are
not all available here), except in the last test, which times this machine's kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.retrieval import bf16_scan, int8_kernels, scan_choice
from ralm.retrieval.scan_choice import TIMING_BATCHES, ScanPlan


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(scan_choice, "_auto", {})
    return monkeypatch


def _machine(mp, *, bf16_hw: bool, int8: tuple[str, ...], ms: dict[str, dict[int, float]] | None = None):
    """A machine with or without bf16 instructions, the int8 kernels ``int8`` exact (at
    their finest levels; the others nowhere), and given timings (ms by path and batch size)."""
    mp.setattr(bf16_scan, "hardware_bf16", lambda: bf16_hw)
    levels = {"fbgemm": (127, 63), "int_mm": (127, 127)}
    mp.setattr(
        int8_kernels, "_levels", {(n, d): levels[n] if n in int8 else None for n in levels for d in (16, 32, 384, 768)}
    )
    timed: list[tuple[str, int]] = []

    def kernel_ms(path, dim, batch, faiss_threads=1):
        timed.append((path, batch))
        return (ms or {})[path][batch]

    mp.setattr(scan_choice, "kernel_ms", kernel_ms)
    return timed


def _curve(b1: float, per_query: float) -> dict[int, float]:
    return {b: b1 + per_query * (b - 1) for b in TIMING_BATCHES}


# FAISS's single query fast (its one-pass scan), its batches dearer (its GEMM path); the int8 scan flat
AVX2 = {"faiss": {1: 10.0, 4: 42.0, 16: 50.0}, "int8:int_mm": _curve(30.0, 0.2)}


def test_each_batch_size_goes_to_the_path_that_is_faster_there(fresh):
    timed = _machine(fresh, bf16_hw=False, int8=("int_mm",), ms=AVX2)
    plan = scan_choice.choose_plan("auto", 384)
    assert plan == ScanPlan("int8", (1,), "int_mm") and plan.timings == AVX2
    assert [plan.route(b) for b in (1, 2, 3, 5, 16, 40)] == ["faiss"] + ["int8"] * 5
    # a small index is not timed: the exact int8 scan
    assert scan_choice.choose_plan("auto", 384, n_rows=scan_choice.TIMING_ROWS - 1) == ScanPlan("int8")
    assert plan.label("int8 +-127") == "faiss at 1, int8 +-127 at 2+"
    assert ScanPlan("int8", (1, 4)).label() == "faiss at 1-4, int8 at 5+"
    assert scan_choice.choose_plan("auto", 384) is plan and len(timed) == 2 * len(TIMING_BATCHES)  # timed once
    assert scan_choice.auto_timings(384) == AVX2


def test_faiss_wins_everywhere_and_no_scan_is_built(fresh):
    _machine(fresh, bf16_hw=False, int8=("int_mm",), ms={"faiss": _curve(5.0, 0.1), "int8:int_mm": _curve(30.0, 0.2)})
    plan = scan_choice.choose_plan("auto", 384)
    assert plan.scan == "faiss" and scan_choice.choose_scan("auto", 384) == "faiss"
    assert {plan.route(b) for b in (1, 4, 16)} == {"faiss"} and plan.label() == "faiss"


def test_the_scan_wins_everywhere(fresh):
    _machine(fresh, bf16_hw=False, int8=("int_mm",), ms={"faiss": _curve(50.0, 5.0), "int8:int_mm": _curve(30.0, 0.2)})
    plan = scan_choice.choose_plan("auto", 384)
    assert plan == ScanPlan("int8", (), "int_mm") and {plan.route(b) for b in (1, 4, 16)} == {"int8"}


def test_the_faster_int8_kernel_is_built(fresh):
    """Both int8 kernels exact: each is timed as its own path, and the cheaper one (summed
    over the batch sizes) is the scan's kernel; FBGEMM's flat batch curve wins here as it did
    on the AVX2-only EPYC, _int_mm's wins on a machine where it is the faster."""
    ms = {"faiss": _curve(6.8, 1.5), "int8:fbgemm": _curve(2.8, 0.5), "int8:int_mm": _curve(19.0, 20.0)}
    timed = _machine(fresh, bf16_hw=False, int8=("fbgemm", "int_mm"), ms=ms)
    plan = scan_choice.choose_plan("auto", 384)
    assert plan == ScanPlan("int8", (), "fbgemm") and {p for p, _ in timed} == set(ms)
    assert plan.label("int8 +-127/63 fbgemm") == "int8 +-127/63 fbgemm"
    fresh.setattr(scan_choice, "_auto", {})
    _machine(fresh, bf16_hw=False, int8=("fbgemm", "int_mm"), ms={**ms, "int8:int_mm": _curve(0.2, 0.07)})
    assert scan_choice.choose_plan("auto", 384) == ScanPlan("int8", (), "int_mm")


def test_bf16_wins_where_it_is_faster_than_int8(fresh):
    ms = {"faiss": _curve(40.0, 3.0), "int8:int_mm": _curve(30.0, 0.2), "bf16": _curve(12.0, 0.5)}
    fresh.setattr(bf16_scan, "_probe_result", True)  # a sound bf16 kernel
    _machine(fresh, bf16_hw=True, int8=("int_mm",), ms=ms)
    plan = scan_choice.choose_plan("auto", 768)
    assert plan == ScanPlan("bf16", ()) and set(plan.timings or {}) == {"faiss", "int8:int_mm", "bf16"}


def test_with_no_low_precision_scan_auto_is_faiss_and_forced_modes_raise(fresh):
    timed = _machine(fresh, bf16_hw=False, int8=(), ms={"faiss": _curve(5.0, 1.0)})
    assert scan_choice.choose_plan("auto", 384) == ScanPlan("faiss") and {p for p, _ in timed} == {"faiss"}
    assert scan_choice.choose_plan("faiss", 384) == ScanPlan("faiss")
    with pytest.raises(RuntimeError, match="no int8 matrix product is exact"):
        scan_choice.choose_plan("int8", 384)
    with pytest.raises(ValueError, match="dense_scan must be one of"):
        scan_choice.choose_plan("fp8", 384)


def test_a_split_plan_gives_the_same_hits_as_every_single_path(fresh):
    """The retriever routes by batch size, and every route returns the same hits."""
    from ralm.retrieval.dense import DenseRetriever

    rng = np.random.default_rng(0)
    X = rng.standard_normal((3000, 32)).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    Q = [X[i] + 0.05 * rng.standard_normal(32).astype(np.float32) for i in range(6)]
    _machine(fresh, bf16_hw=False, int8=("int_mm",), ms=AVX2)
    fresh.setattr(scan_choice, "TIMING_ROWS", 1000)  # an index this small is timed too
    split = DenseRetriever("edr", None, X, dense_scan="auto")
    assert split.dense_scan == "int8" and split.plan.faiss_batches == (1,)
    assert split.scan_label.startswith("faiss at 1, int8")
    # what the stride scheduler reads: each size's cost on its own route, relative to one query
    assert split.batch_cost_curve == {1: 1.0, 4: pytest.approx(30.6 / 10), 16: pytest.approx(33.0 / 10)}
    fresh.setattr(scan_choice, "_auto", {})
    only = {m: DenseRetriever("edr", None, X, dense_scan=m) for m in ("faiss", "int8")}
    for r in only.values():
        assert r.plan.faiss_batches == () and r.batch_cost_curve is None  # forced: not timed
    for batch in ([Q[0]], Q[:2], Q):
        want = only["faiss"].search_vectors(batch, 10)
        assert split.search_vectors(batch, 10) == want == only["int8"].search_vectors(batch, 10)


def test_padding_fits_or_faiss_routes_are_dropped(fresh, monkeypatch):
    from ralm import constants as C
    from ralm.retrieval.dense import DenseRetriever

    X = np.random.default_rng(1).standard_normal((500, 16)).astype(np.float32)
    _machine(fresh, bf16_hw=False, int8=("int_mm",), ms=AVX2)
    fresh.setattr(scan_choice, "TIMING_ROWS", 1000)
    padded = DenseRetriever("edr", None, X, pad_to=5000, dense_scan="auto")
    assert padded.plan.faiss_batches == (1,) and padded.index.ntotal == padded.scan.n_rows == 5000
    monkeypatch.setattr(C, "FAISS_PAD_MAX_BYTES", 1000)
    tight = DenseRetriever("edr", None, X, pad_to=5000, dense_scan="auto")
    assert tight.plan.faiss_batches == () and tight.index.ntotal == 500 and tight.scan.n_rows == 5000


def test_kernel_timing_is_real_and_positive():
    """The timing itself, on this machine's kernels (no mock)."""
    for path in ("faiss", "bf16", *(f"int8:{k}" for k in int8_kernels.exact_kernels(64))):
        assert scan_choice.kernel_ms(path, 64, 4) > 0
    with pytest.raises(ValueError, match="unknown scan path"):
        scan_choice.kernel_ms("int8", 64, 4)
