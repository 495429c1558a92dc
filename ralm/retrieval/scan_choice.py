"""Which exact candidate scan a flat dense index uses: ``faiss``, ``bf16`` or ``int8``.

All three return the same hits (the low-precision scans only propose candidates, which are
re-scored exactly), so the choice is about speed alone:

* ``faiss``: FAISS's float32 kernels. A batch of 16 queries costs about 6 single queries.
* ``bf16``: one bf16 pass for the whole batch. Fast where the CPU has bf16 instructions
  (AMX, AVX512-BF16); emulated and slow elsewhere, so ``auto`` only considers it there.
* ``int8``: one int8 pass for the whole batch, exact integer products. Fast on every x86
  CPU (VNNI or AVX2's ``vpmaddubsw``).

``auto`` picks, in order: the only one of bf16 / int8 that is usable; when both are, the
one whose kernel is faster *on this machine*, timed once per process on a block of rows at
batch 1 and batch 16 (bf16 hardware is not enough: measured on an AMD EPYC with
AVX512-BF16 but no AMX, the full 4M-row bf16 scan took 613 ms at batch 1 where int8 took
162 ms); ``faiss`` when neither is usable.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ralm.retrieval import bf16_scan, int8_scan

log = logging.getLogger(__name__)

SCANS = ("auto", "faiss", "bf16", "int8")
TIMING_ROWS = 1 << 15  # rows per timed kernel call (one scan block)
TIMING_REPS = 3  # best of, per batch size

_lock = threading.Lock()
_auto: dict[int, tuple[str, dict[str, float]]] = {}  # dim -> (choice, ms per kernel)


def kernel_ms(scan: str, dim: int) -> float:
    """Milliseconds of one scan kernel call over :data:`TIMING_ROWS` rows of ``dim``, at
    batch 1 plus batch 16 (best of :data:`TIMING_REPS` each, after a warm-up call)."""
    import torch

    g = torch.Generator().manual_seed(0)
    total = 0.0
    for b in (1, 16):
        if scan == "bf16":
            rows = torch.randn(TIMING_ROWS, dim, generator=g).to(torch.bfloat16)
            q = torch.randn(b, dim, generator=g).to(torch.bfloat16)

            def call(rows=rows, q=q):
                return bf16_scan._scores(rows, q)
        else:
            rows8 = torch.randint(-63, 64, (TIMING_ROWS, dim), dtype=torch.int8, generator=g)
            q8 = torch.randint(-63, 64, (dim, b), dtype=torch.int8, generator=g)

            def call(rows8=rows8, q8=q8):
                return int8_scan._int_scores(rows8, q8)

        call()
        best = np.inf
        for _ in range(TIMING_REPS):
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
        total += best * 1e3
    return total


def choose_scan(mode: str, dim: int) -> str:
    """The scan to build for ``mode`` ('auto', 'faiss', 'bf16', 'int8') over ``dim``-dim rows.

    A forced mode that cannot run exactly here raises ``RuntimeError`` (from the scan's own
    probe) instead of silently falling back."""
    if mode not in SCANS:
        raise ValueError(f"dense_scan must be one of {', '.join(SCANS)}, not {mode!r}")
    if mode == "faiss":
        return "faiss"
    if mode == "bf16":
        bf16_scan.available("bf16")  # raises when unsound
        return "bf16"
    if mode == "int8":
        int8_scan.available("int8")  # raises when no level is exact
        return "int8"
    usable = [s for s, ok in (("bf16", bf16_scan.available("auto")), ("int8", int8_scan.available("auto"))) if ok]
    if len(usable) < 2:
        return usable[0] if usable else "faiss"
    with _lock:
        if dim not in _auto:
            ms = {s: kernel_ms(s, dim) for s in usable}
            pick = min(usable, key=lambda s: ms[s])
            log.info("dense scan auto: %s (kernel ms at batch 1 + 16: %s)", pick, ms)
            _auto[dim] = (pick, ms)
        return _auto[dim][0]


def auto_timings(dim: int) -> dict[str, float] | None:
    """The kernel timings ``auto`` chose by for ``dim`` in this process (None: no timing was
    needed, because at most one low-precision scan is usable)."""
    got = _auto.get(dim)
    return dict(got[1]) if got else None
