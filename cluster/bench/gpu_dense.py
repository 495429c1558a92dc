"""``ralmspec gpu-check``'s dense retrieval sections: ``scan``, a plain float16 top-20 (one
matrix product) timed on the device, and ``dense``, the exact dense scan of a
``dense_scan: gpu`` retriever (:mod:`ralm.retrieval.device_scan`) on the device, timed, with
its candidates checked against the exact float64 top-20 computed on the host."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from cluster.report import table

CHUNK = 1 << 20  # rows per host float64 product when checking


def median_ms(run: Callable[[], Any], sync: Callable[[], None] = lambda: None, reps: int = 5) -> tuple[float, Any]:
    """``(median wall ms of reps calls of run, the last call's result)``; ``sync`` (a device
    synchronisation) before each call, so a call's time is its own."""
    ts, out = [], None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = run()
        ts.append(time.perf_counter() - t)
    return round(sorted(ts)[len(ts) // 2] * 1e3, 2), out


def exact_dense_scans(sizes: list[tuple[int, ...]], device: str, free: Callable[[], None]) -> dict:
    """Per ``(rows, dim)``: build time, and at batch 1 and 16 the candidate search's median
    time over 5 runs, candidates per query, the entries sent to the host, and how many
    queries' candidates contain their exact top-20 (float64 on the host); then batch 16
    again with TF32 turned on after the scan was built (``tf32_after_build``: the product
    the scan ran and the same containment). Rows are random unit vectors; queries are rows
    plus noise."""
    # lazy: loads torch
    from ralm.retrieval.device_scan import DeviceScan

    out: dict[str, Any] = {}
    for n, d in sizes:
        rng = np.random.default_rng(0)
        X = rng.standard_normal((n, d), dtype=np.float32)
        X /= np.linalg.norm(X, axis=1, keepdims=True)
        t = time.perf_counter()
        scan = DeviceScan(X, device=device)
        r: dict[str, Any] = {"build_s": round(time.perf_counter() - t, 1)}
        Q = X[rng.integers(0, n, 16)] + 0.1 * rng.standard_normal((16, d), dtype=np.float32)
        exact = np.concatenate(
            [X[a : a + CHUNK].astype(np.float64) @ Q.astype(np.float64).T for a in range(0, n, CHUNK)]
        )  # (n, 16)
        top = np.argsort(-exact, axis=0, kind="stable")[:20]
        del exact
        for b in (1, 16):
            scan.candidates(Q[:b], 20)  # warm-up
            ms, cands = median_ms(partial(scan.candidates, Q[:b], 20))
            r[f"batch{b}"] = {
                "ms": ms,
                "product": scan.last_product,
                "candidates_per_query": round(float(np.mean([c.size for c in cands])), 1),
                "to_host_per_query": round(scan.last_transferred / b, 1),
                "exact_top20_contained": _contained(top, cands),
            }
        with reduced_fp32_matmul(device):  # TF32 on after the probe and the build
            cands = scan.candidates(Q, 20)
            r["tf32_after_build"] = {"product": scan.last_product, "exact_top20_contained": _contained(top, cands)}
        out[f"{n}x{d}"] = r
        del scan, X
        free()
    return out


def _contained(top: np.ndarray, cands: list[np.ndarray]) -> str:
    """'held/b': the queries whose candidates contain their exact top-20 (``top`` (20, >= b))."""
    held = sum(set(top[:, j].tolist()) <= set(c.tolist()) for j, c in enumerate(cands))
    return f"{held}/{len(cands)}"


@contextlib.contextmanager
def reduced_fp32_matmul(device: str) -> Iterator[None]:
    """Within: torch's float32 matrix products on ``device`` may use TF32 (the setting a user
    turns on for speed); the previous setting is restored after."""
    import torch

    backend = (
        torch.backends.cuda.matmul if device.startswith("cuda") else getattr(torch.backends.mkldnn, "matmul", None)
    )
    if backend is None:  # an older torch: no per-backend switch to turn
        yield
        return
    saved = backend.fp32_precision
    backend.fp32_precision = "tf32"
    try:
        yield
    finally:
        backend.fp32_precision = saved


def dense_markdown(dense: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    if not dense:
        return []
    rows = [
        (
            k,
            b.removeprefix("batch") if b.startswith("batch") else "16, TF32 on after the build",
            r.get("ms", "-"),
            r["product"],
            r.get("candidates_per_query", "-"),
            r.get("to_host_per_query", "-"),
            r["exact_top20_contained"],
        )
        for k, v in dense.items()
        for b, r in v.items()
        if isinstance(r, dict)
    ]
    head = (
        "exact device scan",
        "batch",
        "ms",
        "product",
        "candidates per query",
        "to host per query",
        "exact top-20 contained",
    )
    return [*table(head, rows), ""]


def _topk(X, qs, device: str):
    """Top-20 of ``qs [b, d] @ X [n, d]^T`` (float16 product on a GPU; float32 on a CPU)."""
    import torch

    s = (qs @ X.T).float() if device == "cuda" else (qs.float() @ X.float().T)
    return torch.topk(s, 20, dim=1)


def _top_ids(X, qs, device: str):
    """:func:`_topk`'s indices, on the host (the transfer ends the timed call)."""
    return _topk(X, qs, device).indices.cpu()


def plain_topk_scans(
    sizes: list[tuple[int, ...]], device: str, sync: Callable[[], None], free: Callable[[], None]
) -> dict:
    """Per ``(rows, dim)`` of random float16 vectors, at batch 1, 16 and 64: the median of 5
    top-20 searches (one product, then ``topk``) and whether each query's top-20 is the same
    alone as in the batch."""
    import torch

    out = {}
    for n, d in sizes:
        g = torch.Generator(device=device).manual_seed(0)
        if device == "cuda":
            X = torch.randn(n, d, device=device, generator=g, dtype=torch.float16)
        else:
            X = torch.randn(n, d, generator=g).to(torch.float16)
        r: dict[str, Any] = {}
        q = torch.randn(64, d, device=device, generator=g).to(torch.float16)
        alone = [_topk(X, q[i : i + 1], device).indices for i in range(64)]
        for b in (1, 16, 64):
            ms, ix = median_ms(partial(_top_ids, X, q[:b], device), sync)
            same = sum(torch.equal(ix[i], alone[i][0].cpu()) for i in range(b))
            r[f"batch{b}"] = {"ms": ms, "same_top20_as_alone": f"{same}/{b}"}
        out[f"{n}x{d}"] = r
        del X
        free()
    return out


def scan_markdown(scan: dict) -> list[str]:
    """The ``scan`` section's table (no lines when it did not run)."""
    if not scan:
        return []
    rows = [
        (k, b.removeprefix("batch"), r["ms"], r["same_top20_as_alone"]) for k, v in scan.items() for b, r in v.items()
    ]
    return [*table(("dense scan", "batch", "ms", "top-20 same as alone"), rows), ""]
