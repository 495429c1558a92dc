"""Exact top-k candidates from an int8 scan with a proven error bound (CPUs without bf16).

The bf16 scan (:mod:`ralm.retrieval.bf16_scan`) makes a verification batch cost about one
query on CPUs with bf16 instructions; elsewhere torch emulates bf16 and FAISS's float32
kernels make a batch of 16 cost about 3.5 single queries. Integer dot products are fast
everywhere (AVX2 ``vpmaddubsw``, AVX512-VNNI, AMX-INT8), and an int8 copy of the rows is a
quarter of the float32 bytes, so one pass serves a whole batch.

As with bf16, the int8 scores never rank anything: per query the scan returns a candidate
set that provably contains the exact top-k, and the caller re-scores it exactly.

Quantisation, per row ``x`` (float32, d dims) and per query ``q``:

    s_x = max_i |x_i| / Q,     x~ = round(x / s_x) in [-Q, Q] (int8; Q = 127 or 63),
    x^ = s_x x~,               e_x = x - x^,  r_x = |e_x|  (float64, rounded up)

and the same for ``q``. The kernel returns the integer ``q~ . x~`` exactly (int32
accumulation: d 127^2 < 2^31 for d < 133,000; checked by :func:`probe_kernel`), so
``s^ = s_q s_x (q~ . x~) = q^ . x^`` up to float64 rounding, and

    s - s^ = q^ . e_x + e_q . x^ + e_q . e_x
    |s - s^| <= eps = |q^| r_x + r_q |x^| + r_q r_x        (Cauchy-Schwarz, per term)

For unit vectors in 384 dims, ``s_x`` ~ 0.2/127 and ``r_x`` ~ s_x sqrt(d/12) ~ 0.009, so
eps ~ 0.02: a candidate window about as wide as the bf16 one.

The level Q. Without VNNI (AVX2 only), oneDNN multiplies int8 with ``vpmaddubsw``: one
operand shifted to uint8 (+128), and pairs of u8 x s8 products added in int16 *with
saturation*. At Q = 127 a pair reaches 2 * 255 * 127 = 64,770 > 32,767 and the product is
silently wrong (measured here with ``ONEDNN_MAX_CPU_ISA=AVX2``); at Q = 63 a pair stays
within 2 * 191 * 63 = 24,066, exact. :func:`probe_kernel` tries the levels on worst-case
signs and keeps the largest exact one; the bound above holds for either (r_x doubles at 63).

Pruning a block without converting it. For query ``j`` with floor ``L`` and the block's
largest bound ``E`` (from its largest ``r_x`` and ``|x^|``), a row can be a candidate
only if ``s_q s_x n >= T = L - E`` (``n`` its integer score). Over the block's row scales
``[s_min, s_max]`` that needs ``n >= T / (s_q s_max)`` when ``T > 0`` and
``n >= T / (s_q s_min)`` otherwise; the integer limit is taken one below the floor of
that, so only rows that surely fail are skipped. Survivors are converted and tested with
their own (row, query) bound.

Worked example (d = 2): x = (0.5, -0.25): s_x = 0.5/127, x~ = (127, -64) (-63.5 rounds
to even), x^ = (0.5, -0.2519685), r_x = 0.0019685. q = (1, 0): s_q = 1/127, q~ = (127, 0),
r_q = 0. n = 127 * 127 = 16129, s^ = 16129 / 127 * 0.5 / 127 = 0.5 = s; eps = |q^| r_x =
0.0019685.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ralm.retrieval.int8_widths import padded_width
from ralm.retrieval.scan_bounds import CandidateTracker, query_matrix, trivial_candidates

log = logging.getLogger(__name__)

QMAX = 127
LEVELS = (QMAX, 63)  # code ranges tried by the probe, the finest first
BLOCK_ROWS = 1 << 15  # rows per integer product: 32768 x 384 int8 = 12 MiB
ABS_SLACK = 1e-12  # float64 arithmetic of s^ and of the bound
ROUND_UP = 1 + 1e-9  # norms computed in float64, rounded up

_probe_lock = threading.Lock()
_probe_result: int | None = None


def quantize(x: np.ndarray, qmax: int = QMAX) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(m, d) float32 -> int8 codes (m, d) in [-qmax, qmax], scales (m,) float64, |x^| (m,),
    r_x = |x - x^| (m,).

    A zero row gets scale 1 and codes 0 (x^ = 0, r_x = 0)."""
    x64 = np.asarray(x, dtype=np.float64)
    amax = np.abs(x64).max(axis=1)
    scale = np.where(amax > 0, amax / qmax, 1.0)  # (m,)
    codes = np.clip(np.rint(x64 / scale[:, None]), -qmax, qmax)
    xhat = codes * scale[:, None]
    r = np.sqrt(np.einsum("ij,ij->i", x64 - xhat, x64 - xhat)) * ROUND_UP
    xn = np.sqrt(np.einsum("ij,ij->i", xhat, xhat)) * ROUND_UP
    return codes.astype(np.int8), scale, xn, r


def _int_scores(rows, queries_t):
    """int8 (B, d) x int8 (d, b) -> int32 (B, b), exact (the one kernel used)."""
    import torch

    return torch._int_mm(rows, queries_t)


def _worst_case(q: int, d: int = 384) -> tuple:
    """int8 (64, d) and (d, 16) at the level ``q``: random codes plus rows and columns of
    constant and alternating signs at +-q (the largest pair sums a kernel can meet)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-q, q + 1, (64, d), dtype=torch.int8, generator=g)
    b = torch.randint(-q, q + 1, (d, 16), dtype=torch.int8, generator=g)
    a[0], a[1] = q, -q  # d q^2: the largest sum the scan can meet
    a[2, ::2], a[2, 1::2] = q, -q
    b[:, 0], b[:, 1] = q, -q
    b[::2, 2], b[1::2, 2] = q, -q
    b[::2, 3], b[1::2, 3] = -q, q
    return a, b


def probe_kernel() -> int:
    """The largest code level of :data:`LEVELS` at which torch's int8 matrix product is
    exact on this machine (checked against an int64 product on worst-case signs); 0 when
    none is (or torch has no int8 product)."""
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        level = 0
        try:
            for q in LEVELS:
                a, b = _worst_case(q)
                if bool((_int_scores(a, b).long() == a.long() @ b.long()).all()):
                    level = q
                    break
                log.info("int8 products saturate at level %d on this machine", q)
        except Exception as exc:  # no torch._int_mm on this build
            log.info("int8 scan unavailable: %s", exc)
        _probe_result = level
        return level


class Int8Scan:
    """An int8 copy of a flat inner-product KB (real rows, then padding rows) and its
    candidate search; the interface of :class:`~ralm.retrieval.bf16_scan.Bf16Scan`.

    ``rows``: (n_real, d) float32 in id order. ``pad_chunks``: float32 (m, d) chunks
    appended after them (never returned; they only cost scan time).
    """

    metric = "ip"

    def __init__(
        self,
        rows: np.ndarray,
        pad_chunks: Iterable[np.ndarray] = (),
        *,
        pad_rows: int = 0,
        block_rows: int = BLOCK_ROWS,
        qmax: int | None = None,
    ):
        import torch

        self.qmax = probe_kernel() if qmax is None else int(qmax)
        if not 0 < self.qmax <= QMAX:
            raise RuntimeError("no int8 code level gives exact products on this machine; use dense_scan='faiss'")

        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError("rows must be a non-empty (n, d) array")
        self.n_real, self.dim = rows.shape
        if self.dim * self.qmax * self.qmax >= 2**31:
            raise ValueError(f"{self.dim} dims could overflow the int32 accumulator")
        self.n_rows = self.n_real + int(pad_rows)
        self.block_rows = int(block_rows)
        data = torch.empty((self.n_rows, self.dim), dtype=torch.int8)  # (N, d)
        self.scale = np.empty(self.n_real)  # (n_real,) float64 s_x
        self.xhat_norm = np.empty(self.n_real)  # (n_real,) |x^|
        self.resid = np.empty(self.n_real)  # (n_real,) r_x
        for s in range(0, self.n_real, self.block_rows):  # chunked: no full float64 copy
            e = min(s + self.block_rows, self.n_real)
            codes, self.scale[s:e], self.xhat_norm[s:e], self.resid[s:e] = quantize(rows[s:e], self.qmax)
            data[s:e] = torch.from_numpy(codes)
        at = self.n_real
        for chunk in pad_chunks:
            m = chunk.shape[0]
            data[at : at + m] = torch.from_numpy(quantize(chunk, self.qmax)[0])
            at += m
        if at != self.n_rows:
            raise ValueError(f"padding chunks gave {at - self.n_real} rows, expected {pad_rows}")
        self.data = data
        self.pad_widths = True  # False: each batch at its own width (``ralmspec costs --scans int8-own-widths``)
        padded_width(2, self.dim)  # probe the kernel's batch widths now, not in the first verification
        # per block, over its real rows: scale range and largest |x^| and r_x (the block bound)
        self._blocks: list[tuple[float, float, float, float] | None] = []
        for s in range(0, self.n_rows, self.block_rows):
            a, b = s, min(s + self.block_rows, self.n_real)
            if a < b:
                sl = slice(a, b)
                self._blocks.append(
                    (
                        float(self.scale[sl].min()),
                        float(self.scale[sl].max()),
                        float(self.xhat_norm[sl].max()),
                        float(self.resid[sl].max()),
                    )
                )
            else:
                self._blocks.append(None)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per query, sorted real row ids that contain its exact top-``k``.

        ``queries``: (b, d) float32. Costs one pass over the int8 rows for the batch.
        """
        import torch

        Q = query_matrix(queries, self.dim)  # (b, d)
        b, k = Q.shape[0], int(k)
        done = trivial_candidates(b, k, self.n_real)
        if done is not None:
            return done
        q_codes, q_scale, q_norm, q_resid = quantize(Q, self.qmax)  # (b, d) int8, (b,) x3
        w = padded_width(b, self.dim) if self.pad_widths else b  # zero columns up to a cheaper width
        Qt = torch.zeros((self.dim, w), dtype=torch.int8)  # (d, w) int8
        Qt[:, :b] = torch.from_numpy(np.ascontiguousarray(q_codes.T))
        track = CandidateTracker(b, k)
        for bi, start in enumerate(range(0, self.n_rows, self.block_rows)):
            blk = self._blocks[bi]
            if blk is None:
                # padding only: scanned for its cost, never a candidate
                _int_scores(self.data[start : start + self.block_rows], Qt)
                continue
            s_min, s_max, xn_max, r_max = blk
            stop = min(start + self.block_rows, self.n_rows)
            n = _int_scores(self.data[start:stop], Qt)  # (B, w) int32
            real = min(stop, self.n_real) - start
            n = n[:real, :b]
            eps_blk = q_norm * r_max + q_resid * xn_max + q_resid * r_max + ABS_SLACK  # (b,)
            L = track.L
            if np.isfinite(L).all():
                T = L - eps_blk  # (b,) a row needs s^ >= T
                lim = np.where(T > 0, T / (q_scale * s_max), T / (q_scale * s_min))
                lim = np.clip(np.floor(lim) - 1, -(2**31), 2**31 - 1).astype(np.int32)
                rows_i, cols_i = torch.nonzero(n >= torch.from_numpy(lim), as_tuple=True)
            else:  # the first block: every entry, and the floor from its k best lower bounds
                rows_i, cols_i = torch.nonzero(torch.ones_like(n, dtype=torch.bool), as_tuple=True)
            if rows_i.numel() == 0:
                continue
            r_np = rows_i.numpy().astype(np.int64)
            c_np = cols_i.numpy()
            ids = r_np + start
            vals = n[rows_i, cols_i].numpy().astype(np.float64) * q_scale[c_np] * self.scale[ids]
            eps = (
                q_norm[c_np] * self.resid[ids]
                + q_resid[c_np] * self.xhat_norm[ids]
                + q_resid[c_np] * self.resid[ids]
                + ABS_SLACK
            )
            if not np.isfinite(track.L).all() and real >= k:
                lower = np.full((real, b), -np.inf)
                lower[r_np, c_np] = vals - eps
                track.raise_floor(np.partition(lower, real - k, axis=0)[real - k])
            track.add(ids, c_np, vals, eps)
        return track.result()


def available(mode: str = "int8") -> bool:
    """Whether the int8 scan can run: 'int8' requires it (an error when no code level is
    exact here), 'auto' asks (see :mod:`ralm.retrieval.scan_choice`), others never."""
    if mode not in ("auto", "int8"):
        return False
    if not probe_kernel():
        if mode == "int8":
            raise RuntimeError("dense_scan='int8' but torch's int8 matrix product is not exact on this machine")
        return False
    return True
