"""``ralmspec gpu-check``'s dense retrieval sections: ``scan``, a plain float16 top-20 (one
matrix product) timed on the device, and ``dense``, the exact dense scan of a
``dense_scan: gpu`` retriever (:mod:`ralm.retrieval.device_scan`) on the device, timed, with
its candidates checked against the exact float64 top-20 computed on the host."""

from __future__ import annotations

import time
from collections.abc import Callable
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
    time over 5 runs, candidates per query, and how many queries' candidates contain their
    exact top-20. Rows are random unit vectors; queries are rows plus noise."""
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
        for b in (1, 16):
            scan.candidates(Q[:b], 20)  # warm-up
            ms, cands = median_ms(partial(scan.candidates, Q[:b], 20))
            exact = np.concatenate(
                [X[a : a + CHUNK].astype(np.float64) @ Q[:b].astype(np.float64).T for a in range(0, n, CHUNK)]
            )  # (n, b)
            top = np.argsort(-exact, axis=0, kind="stable")[:20]
            held = sum(set(top[:, j].tolist()) <= set(cands[j].tolist()) for j in range(b))
            r[f"batch{b}"] = {
                "ms": ms,
                "candidates_per_query": round(float(np.mean([c.size for c in cands])), 1),
                "exact_top20_contained": f"{held}/{b}",
            }
        out[f"{n}x{d}"] = r
        del scan, X
        free()
    return out


def dense_markdown(dense: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    if not dense:
        return []
    rows = [
        (k, b.removeprefix("batch"), r["ms"], r["candidates_per_query"], r["exact_top20_contained"])
        for k, v in dense.items()
        for b, r in v.items()
        if isinstance(r, dict)
    ]
    head = ("exact device scan", "batch", "ms", "candidates per query", "exact top-20 contained")
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
