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

The levels and the kernel. The integer products come from one of the kernels of
:mod:`ralm.retrieval.int8_kernels` (torch's ``_int_mm`` or FBGEMM), each checked at start-up
against an int64 product on worst-case signs at the index's dimension. A kernel may be exact
only at coarser codes: without VNNI (AVX2 only), oneDNN and FBGEMM multiply with
``vpmaddubsw``, one operand as uint8, and add pairs of u8 x s8 products in int16 *with
saturation*. ``_int_mm`` shifts an operand by +128, so at Q = 127 a pair reaches 2 * 255 *
127 = 64,770 > 32,767 and the product is silently wrong (measured with
``ONEDNN_MAX_CPU_ISA=AVX2``); at Q = 63 a pair stays within 2 * 191 * 63 = 24,066, exact.
FBGEMM takes rows at 127 and queries at 63 (its input is 7-bit: 2 * 127 * 127 < 32,767). Rows
and queries have their own levels; the bound above holds for any (r_x doubles at 63).

Squared distance (``metric='l2'``, KNN-LM's datastore). The smallest ``|q - x|^2`` is the
largest ``t = 2 q.x - |x|^2`` (``|q|^2`` is the same for every row). With ``|x|^2`` exact in
float64 (from the float32 row, rounded up by ``SQ_SLACK`` relative), ``t^ = 2 s^ - |x|^2`` is
within ``2 eps + SQ_SLACK |x|^2`` of ``t``, and the candidate rule below runs on ``t``.
Worked example: the row above with ``|x|^2 = 0.3125`` gives ``t^ = 2 * 0.5 - 0.3125 =
0.6875``, within ``2 * 0.0019685`` (plus the slack) of ``t``.

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
from collections.abc import Iterable, Sequence

import numpy as np

from ralm.retrieval import int8_kernels
from ralm.retrieval.scan_bounds import CandidateTracker, query_matrix, trivial_candidates

log = logging.getLogger(__name__)

QMAX = 127
BLOCK_ROWS = 1 << 15  # rows per integer product: 32768 x 384 int8 = 12 MiB
ABS_SLACK = 1e-12  # float64 arithmetic of s^ and of the bound
ROUND_UP = 1 + 1e-9  # norms computed in float64, rounded up
SQ_SLACK = 1e-12  # relative: |x|^2 in float64 from float32 rows, and t^'s float64 arithmetic


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


class Int8Scan:
    """An int8 copy of a flat KB (real rows, then padding rows) and its candidate search; the
    interface of :class:`~ralm.retrieval.bf16_scan.Bf16Scan`.

    ``rows``: (n_real, d) float32 in id order. ``pad_chunks``: float32 (m, d) chunks
    appended after them (never returned; they only cost scan time). ``metric``: 'ip'
    (largest inner product) or 'l2' (smallest squared distance). ``kernel``: the integer
    product ('fbgemm', 'int_mm'; None: the first exact one here); ``levels``: its (row,
    query) code levels (None: the finest at which it is exact here).
    """

    def __init__(
        self,
        rows: np.ndarray,
        pad_chunks: Iterable[np.ndarray] = (),
        *,
        pad_rows: int = 0,
        block_rows: int = BLOCK_ROWS,
        kernel: str | None = None,
        levels: tuple[int, int] | None = None,
        metric: str = "ip",
    ):
        import torch

        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be 'ip' or 'l2', not {metric!r}")
        self.metric = metric
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError("rows must be a non-empty (n, d) array")
        self.n_real, self.dim = rows.shape
        name = kernel or int8_kernels.default_kernel(self.dim)
        if name is None:
            raise RuntimeError("no int8 kernel gives exact products on this machine; use dense_scan='faiss'")
        self.kernel = int8_kernels.kernel(name)
        levels = levels or int8_kernels.exact_levels(name, self.dim)
        if levels is None:
            raise RuntimeError(f"the {name} int8 kernel is not exact on this machine at any code level")
        self.qmax, self.query_qmax = (int(v) for v in levels)  # row and query code levels
        if not (0 < self.qmax <= QMAX and 0 < self.query_qmax <= QMAX):
            raise ValueError(f"int8 code levels must be in 1..{QMAX}, not {levels}")
        if self.dim * self.qmax * self.query_qmax >= 2**31:
            raise ValueError(f"{self.dim} dims could overflow the int32 accumulator")
        self.n_rows = self.n_real + int(pad_rows)
        self.block_rows = int(block_rows)
        data = torch.empty((self.n_rows, self.dim), dtype=torch.int8)  # (N, d)
        self.scale = np.empty(self.n_real)  # (n_real,) float64 s_x
        self.xhat_norm = np.empty(self.n_real)  # (n_real,) |x^|
        self.resid = np.empty(self.n_real)  # (n_real,) r_x
        self.sq = np.zeros(self.n_real)  # (n_real,) |x|^2, float64 (l2 only)
        for s in range(0, self.n_real, self.block_rows):  # chunked: no full float64 copy
            e = min(s + self.block_rows, self.n_real)
            codes, self.scale[s:e], self.xhat_norm[s:e], self.resid[s:e] = quantize(rows[s:e], self.qmax)
            data[s:e] = torch.from_numpy(codes)
            if metric == "l2":
                x64 = rows[s:e].astype(np.float64)
                self.sq[s:e] = np.einsum("ij,ij->i", x64, x64)
        at = self.n_real
        for chunk in pad_chunks:
            m = chunk.shape[0]
            data[at : at + m] = torch.from_numpy(quantize(chunk, self.qmax)[0])
            at += m
        if at != self.n_rows:
            raise ValueError(f"padding chunks gave {at - self.n_real} rows, expected {pad_rows}")
        # the kernel's operand per block (the codes themselves, or FBGEMM's packed copy)
        self._ops = [self.kernel.rows(data[s : s + self.block_rows]) for s in range(0, self.n_rows, self.block_rows)]
        del data  # FBGEMM keeps its packed copy only
        self.kernel.queries(np.zeros((2, self.dim), dtype=np.int8))  # probe int_mm's widths now
        # per block, over its real rows: scale range, largest |x^| and r_x (the block bound), and
        # the smallest and largest |x|^2 (l2's pruning limit; 0 for ip)
        self._blocks: list[tuple[float, float, float, float, float, float] | None] = []
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
                        float(self.sq[sl].min()),
                        float(self.sq[sl].max()),
                    )
                )
            else:
                self._blocks.append(None)

    @property
    def label(self) -> str:
        """For report headers: 'int8 +-127/63 fbgemm' (row / query levels when they differ)."""
        levels = f"{self.qmax}" if self.qmax == self.query_qmax else f"{self.qmax}/{self.query_qmax}"
        return f"int8 +-{levels} {self.kernel.name}"

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.dim

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per query, sorted real row ids that contain its exact top-``k`` (largest inner
        product, or smallest squared distance with ``metric='l2'``).

        ``queries``: (b, d) float32. Costs one pass over the int8 rows for the batch.
        """
        import torch

        Q = query_matrix(queries, self.dim)  # (b, d)
        b, k = Q.shape[0], int(k)
        done = trivial_candidates(b, k, self.n_real)
        if done is not None:
            return done
        q_codes, q_scale, q_norm, q_resid = quantize(Q, self.query_qmax)  # (b, d) int8, (b,) x3
        q_op = self.kernel.queries(q_codes)
        l2 = self.metric == "l2"
        track = CandidateTracker(b, k)
        for bi, start in enumerate(range(0, self.n_rows, self.block_rows)):
            blk = self._blocks[bi]
            if blk is None:
                # padding only: scanned for its cost, never a candidate
                self.kernel.scores(self._ops[bi], q_op, b)
                continue
            s_min, s_max, xn_max, r_max, sq_min, sq_max = blk
            stop = min(start + self.block_rows, self.n_rows)
            n = self.kernel.scores(self._ops[bi], q_op, b)  # (B, b) int32
            real = min(stop, self.n_real) - start
            n = n[:real]
            eps_blk = q_norm * r_max + q_resid * xn_max + q_resid * r_max + ABS_SLACK  # (b,)
            L = track.L
            if np.isfinite(L).all():
                # ip: a row needs s^ >= L - eps. l2: t^ + 2 eps + slack >= L needs s^ >= (L +
                # |x|^2) / 2 - eps - slack / 2, at least (L + min |x|^2) / 2 - eps - slack, where
                # near the floor |t^| <= |L| + 2 eps bounds the slack
                if l2:
                    T = (L + sq_min) / 2 - eps_blk - SQ_SLACK * (np.abs(L) + 2 * eps_blk + sq_max)  # (b,)
                else:
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
            if l2:  # t^ = 2 s^ - |x|^2, within 2 eps plus the slack of t
                sq = self.sq[ids]
                vals = 2 * vals - sq
                eps = 2 * eps + SQ_SLACK * (np.abs(vals) + sq)
            track.add_block(r_np, c_np, vals, eps, real, start)
        return track.result()


def available(mode: str = "int8", dim: int = 384) -> bool:
    """Whether the int8 scan can run for ``dim`` dimensions: 'int8' requires it (an error
    when no kernel is exact here), 'auto' asks (see :mod:`ralm.retrieval.scan_choice`),
    others never."""
    if mode not in ("auto", "int8"):
        return False
    if not int8_kernels.exact_kernels(dim):
        if mode == "int8":
            raise RuntimeError("dense_scan='int8' but no int8 matrix product is exact on this machine")
        return False
    return True
