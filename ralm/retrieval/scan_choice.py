"""How an exact flat dense index answers a batch of queries: FAISS, or a bf16 or int8 scan.

Every path returns the same hits (FAISS's candidates and the low-precision scans' are
re-scored exactly in float64), so the choice is about speed alone, and it may differ by
batch size:

* ``faiss``: FAISS's float32 kernels. One query takes its one-pass SIMD scan; a batch takes
  its BLAS path (one GEMM over the index for all queries; see
  ``DenseRetriever._faiss_search``).
* ``bf16``: one bf16 pass for the whole batch. Fast where the CPU has bf16 instructions
  (AMX, AVX512-BF16); emulated and slow elsewhere, so ``auto`` only considers it there.
* ``int8``: one int8 pass for the whole batch, exact integer products (VNNI or AVX2's
  ``vpmaddubsw``) from one of two kernels, torch's ``_int_mm`` or FBGEMM
  (:mod:`ralm.retrieval.int8_kernels`), timed separately as ``int8:int_mm`` and
  ``int8:fbgemm``.

``auto`` measures, once per process and dimension, every path that can run exactly here at
batch 1 and at the verification batch sizes 4 and 16, each over a block of
:data:`TIMING_ROWS` rows (larger than a CPU's last-level cache, so memory traffic counts as
it does over a whole index; a second or two). An index smaller than that block is not worth
timing: it takes the int8 scan where it is exact, else bf16, else FAISS. It builds the
low-precision scan (and int8 kernel) that is cheaper summed over those sizes, and routes
each batch size to whichever of that scan and FAISS measured faster at it. Measured on a
2-core AVX2-only AMD EPYC at 4M rows (docs/results): ``_int_mm``'s int8 scan lost to FAISS
at every size, FBGEMM's beat FAISS at every size. Elsewhere FAISS's single query may beat
a scan whose batches beat FAISS's: a plan that sends single queries to FAISS and
verification batches to the scan then beats either alone. Forced modes (``faiss``,
``bf16``, ``int8``) use one path for every batch and never fall back (``int8`` takes the
first exact kernel of :data:`~ralm.retrieval.int8_kernels.KERNELS`). ``gpu`` scans a float16
copy on the process's CUDA device (:mod:`ralm.retrieval.device_scan`); ``auto`` never picks
it, because the index then takes memory from whatever else runs on that GPU.

Worked example: timings (ms per block) faiss {1: 10, 4: 33, 16: 45}, int8:fbgemm {1: 30, 4:
31, 16: 34}, int8:int_mm {1: 40, 4: 90, 16: 300} -> the int8 scan is built on FBGEMM, batch
1 goes to FAISS, and batches of 2 and more go to the scan (a size between two timed ones
takes the larger one's route).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ralm import constants as C
from ralm.retrieval import bf16_scan, int8_kernels, scans
from ralm.retrieval.faiss_search import FaissScan, faiss_search

log = logging.getLogger(__name__)

SCAN_MODES = ("auto", "faiss", *scans.SCANS)  # retriever.dense_scan: a registered scan, FAISS, or timed
TIMING_ROWS = 1 << 16  # rows per timed call: 96 MiB of float32 at 384 dims, beyond a CPU's L3 cache
TIMING_BATCHES = (1, 4, 16)  # a direct step and the verification batch sizes OS3 uses (2-16)
TIMING_REPS = 2  # best of, per batch size (after a warm-up call)
TIMING_K = 36  # candidates per query: top-20 plus the re-scoring margin

_lock = threading.Lock()
_auto: dict[tuple[int, int], ScanPlan] = {}  # (dim, faiss threads) -> plan


@dataclass(frozen=True)
class ScanPlan:
    """``scan``: the low-precision scan to build ('bf16', 'int8'; 'faiss': none);
    ``faiss_batches``: timed batch sizes that go to FAISS although a scan is built;
    ``int8_kernel``: the int8 scan's kernel ('fbgemm', 'int_mm'; None: the first exact one);
    ``timings``: ms per :data:`TIMING_ROWS` rows by path and batch size (None: not timed;
    int8 paths are named 'int8:KERNEL')."""

    scan: str
    faiss_batches: tuple[int, ...] = ()
    int8_kernel: str | None = None
    timings: dict[str, dict[int, float]] | None = field(default=None, compare=False)

    def route(self, batch: int) -> str:
        """The path a batch of ``batch`` queries takes: 'faiss' or :attr:`scan`. A size between
        two timed ones takes the larger one's route; beyond the largest, the largest's."""
        if self.scan == "faiss":
            return "faiss"
        timed = next((b for b in TIMING_BATCHES if b >= batch), TIMING_BATCHES[-1])
        return "faiss" if timed in self.faiss_batches else self.scan

    def path_key(self, batch: int) -> str:
        """The :attr:`timings` key of the path a batch of ``batch`` queries takes."""
        path = self.route(batch)
        return f"int8:{self.int8_kernel}" if path == "int8" and self.int8_kernel else path

    def cost_curve(self) -> dict[int, float] | None:
        """Measured cost of a batch of each timed size relative to one query, each on the path
        it takes (None: not timed). The stride scheduler reads it before it has measured a
        batch itself (:class:`~ralm.stride.os3.StrideScheduler`).

        >>> ScanPlan("int8", (1,), "fbgemm", {"faiss": {1: 5.0, 4: 20.0, 16: 30.0},
        ...     "int8:fbgemm": {1: 8.0, 4: 9.0, 16: 12.0}}).cost_curve()
        {1: 1.0, 4: 1.8, 16: 2.4}
        """
        if not self.timings:
            return None
        try:
            one = self.timings[self.path_key(1)][1]
            return {b: round(self.timings[self.path_key(b)][b] / one, 6) for b in TIMING_BATCHES}
        except (KeyError, ZeroDivisionError):
            return None

    def label(self, scan_label: str | None = None) -> str:
        """For report headers: 'int8 +-127', or 'faiss at 1, int8 +-127 at 2+'."""
        name = scan_label or self.scan
        if self.scan == "faiss" or not self.faiss_batches:
            return name
        spans: list[list] = []  # [first size, last size (None: no end), path], merged
        lo = 1
        for i, b in enumerate(TIMING_BATCHES):
            path = "faiss" if b in self.faiss_batches else name
            hi = None if i == len(TIMING_BATCHES) - 1 else b
            if spans and spans[-1][2] == path:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi, path])
            lo = b + 1
        return ", ".join(
            f"{p} at {a}+" if z is None else f"{p} at {a}" if a == z else f"{p} at {a}-{z}" for a, z, p in spans
        )


def kernel_ms(path: str, dim: int, batch: int, faiss_threads: int = 1) -> float:
    """Milliseconds of one search of ``batch`` random queries over :data:`TIMING_ROWS` random
    rows of ``dim`` on ``path`` ('faiss', 'bf16', 'int8:KERNEL'; best of :data:`TIMING_REPS`,
    after a warm-up call)."""
    import torch

    g = torch.Generator().manual_seed(0)
    if path == "faiss":
        import faiss

        faiss.omp_set_num_threads(max(1, int(faiss_threads)))
        index = faiss.IndexFlatIP(dim)
        index.add(torch.randn(TIMING_ROWS, dim, generator=g).numpy())
        Q = torch.randn(batch, dim, generator=g).numpy()

        def call():
            return faiss_search(index, Q, TIMING_K)
    elif path == "bf16":
        rows = torch.randn(TIMING_ROWS, dim, generator=g).to(torch.bfloat16)
        q = torch.randn(batch, dim, generator=g).to(torch.bfloat16)

        def call():
            return torch.topk(bf16_scan._scores(rows, q), TIMING_K, dim=0)
    elif path.startswith("int8:"):
        k = int8_kernels.kernel(path.split(":", 1)[1])
        op = k.rows(torch.randint(-63, 64, (TIMING_ROWS, dim), dtype=torch.int8, generator=g))
        q_op = k.queries(torch.randint(-63, 64, (batch, dim), dtype=torch.int8, generator=g).numpy())

        def call():
            return torch.topk(k.scores(op, q_op, batch), TIMING_K, dim=0)
    else:
        raise ValueError(f"unknown scan path {path!r}")

    call()
    best = np.inf
    for _ in range(TIMING_REPS):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return float(best * 1e3)


def choose_plan(mode: str, dim: int, faiss_threads: int = 1, n_rows: int | None = None) -> ScanPlan:
    """The :class:`ScanPlan` for ``mode`` ('auto', 'faiss', or a registered scan: 'bf16', 'int8',
    'gpu') over ``n_rows`` rows of ``dim`` (None: a large index).

    A forced mode that cannot run exactly here raises ``RuntimeError`` (from the scan's own
    probe) instead of silently falling back."""
    if mode not in SCAN_MODES:
        raise ValueError(f"dense_scan must be one of {', '.join(SCAN_MODES)}, not {mode!r}")
    if mode == "faiss":
        return ScanPlan("faiss")
    if mode != "auto":
        scans.scan_kind(mode).available(mode, dim)  # raises when it cannot run exactly here
        return ScanPlan(mode)
    usable = (["bf16"] if bf16_scan.available("auto") else []) + [f"int8:{k}" for k in int8_kernels.exact_kernels(dim)]
    if n_rows is not None and n_rows < TIMING_ROWS:  # small: any path is fast, none is worth timing
        return ScanPlan(usable[-1].partition(":")[0] if usable else "faiss")  # int8 where exact, else bf16
    key = (int(dim), int(faiss_threads))
    with _lock:
        if key not in _auto:
            _auto[key] = _measure(usable, dim, faiss_threads)
        return _auto[key]


def _measure(usable: list[str], dim: int, faiss_threads: int) -> ScanPlan:
    t = {p: {b: kernel_ms(p, dim, b, faiss_threads) for b in TIMING_BATCHES} for p in ["faiss", *usable]}
    if not usable:
        plan = ScanPlan("faiss", (), None, t)
    else:
        path = min(usable, key=lambda s: sum(t[s].values()))
        scan, _, kernel = path.partition(":")
        to_faiss = tuple(b for b in TIMING_BATCHES if t["faiss"][b] < t[path][b])
        if len(to_faiss) == len(TIMING_BATCHES):
            plan = ScanPlan("faiss", (), None, t)
        else:
            plan = ScanPlan(scan, to_faiss, kernel or None, t)
    log.info("dense scan auto: %s (ms per %d rows by batch size: %s)", plan.label(), TIMING_ROWS, t)
    return plan


def choose_scan(mode: str, dim: int, faiss_threads: int = 1) -> str:
    """The low-precision scan ``mode`` builds ('bf16', 'int8'), or 'faiss' for none."""
    return choose_plan(mode, dim, faiss_threads).scan


class RoutedScan:
    """One candidate scan (:class:`~ralm.retrieval.scans.CandidateScan`) that sends each batch,
    by its size, to the plan's low-precision scan or to FAISS (:meth:`ScanPlan.route`).

    ``low``: the built scan of ``plan.scan`` (None for 'faiss'); ``faiss``: FAISS's candidate
    stage (:class:`~ralm.retrieval.faiss_search.FaissScan`; None when the plan never routes
    to it)."""

    def __init__(self, plan: ScanPlan, low: scans.CandidateScan | None, faiss: FaissScan | None):
        if (low is None) != (plan.scan == "faiss") or (faiss is None and (plan.scan == "faiss" or plan.faiss_batches)):
            raise ValueError(f"the scans built do not match the plan {plan}")
        self.plan = plan
        self.low = low
        self.faiss = faiss
        self.n_real = (low or faiss).n_real  # type: ignore[union-attr]
        self.n_rows = (low or faiss).n_rows  # type: ignore[union-attr]

    @property
    def name(self) -> str:
        """The scan in use: 'faiss' or the registered scan's name ('bf16', 'int8', 'gpu')."""
        return self.plan.scan

    @property
    def label(self) -> str:
        """The paths in use for report headers: the scan's own label ('int8 +-127/63 fbgemm'),
        and the batch sizes FAISS answers when it answers some ('faiss at 1, int8 +-127 at 2+')."""
        return self.plan.label(self.low.label if self.low is not None else None)

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        path = self.faiss if self.plan.route(len(queries)) == "faiss" else self.low
        return path.candidates(queries, k)  # type: ignore[union-attr]


def plan_scan(
    mode: str,
    rows: np.ndarray,
    index: Any,
    score_ids: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    flat: bool = True,
    pad_rows: int = 0,
    pad_chunks: Callable[[int], Iterable[np.ndarray]] = lambda n: (),
    rerank_margin: int = C.RERANK_MARGIN,
    faiss_threads: int = C.FAISS_THREADS,
    int8_kernel: str | None = None,
    stats: dict | None = None,
) -> RoutedScan:
    """The built candidate scan of a dense index for ``mode``: its plan (:func:`choose_plan`;
    an index that is not ``flat`` always takes FAISS), the plan's scan over ``rows`` and
    ``pad_rows`` padding rows (``pad_chunks(n)`` yields them), and FAISS's stage over ``index``
    when the plan routes batches to it (its index padded to match, when that fits in
    :data:`~ralm.constants.FAISS_PAD_MAX_BYTES`; else every batch goes to the scan).
    ``score_ids(query, ids)``: the exact scores FAISS's candidates are re-scored with."""
    n_real, dim = rows.shape
    plan = choose_plan(mode if flat else "faiss", dim, faiss_threads, n_real + int(pad_rows))
    if plan.faiss_batches and pad_rows * dim * 4 > C.FAISS_PAD_MAX_BYTES:
        # padding the FAISS index as well would not fit: every batch goes to the scan
        log.warning(
            "dense scan: FAISS routes dropped (padding its index to %d rows would take %.1f GiB)",
            n_real + pad_rows,
            pad_rows * dim * 4 / 2**30,
        )
        plan = ScanPlan(plan.scan, (), plan.int8_kernel, plan.timings)
    low = None
    if plan.scan != "faiss":
        kernel = int8_kernel or plan.int8_kernel
        low = scans.make_scan(plan.scan, rows, pad_chunks(pad_rows), pad_rows=pad_rows, int8_kernel=kernel)
    faiss = None
    if plan.scan == "faiss" or plan.faiss_batches:
        if index is None:
            raise RuntimeError(
                f"the {plan.scan} scan's plan routes batches {list(plan.faiss_batches)} to FAISS, "
                "which is not installed here: pip install faiss-cpu, or choose dense_scan bf16, int8 or gpu"
            )
        for chunk in pad_chunks(pad_rows):  # FAISS answers some batches: it costs what the scan does
            index.add(chunk)
        faiss = FaissScan(
            index, n_real, score_ids, rerank_margin=rerank_margin, flat=flat, faiss_threads=faiss_threads, stats=stats
        )
    return RoutedScan(plan, low, faiss)


def auto_timings(dim: int, faiss_threads: int = 1) -> dict[str, dict[int, float]] | None:
    """The timings ``auto`` chose by for ``dim`` in this process (None: not measured yet)."""
    got = _auto.get((int(dim), int(faiss_threads)))
    return None if got is None or got.timings is None else {p: dict(v) for p, v in got.timings.items()}
