"""Exact top-k candidates from a bfloat16 scan with a proven error bound.

A flat dense KB spends its time streaming its rows from memory. On CPUs with bf16
matrix units (AMX, AVX512-BF16) a bf16 copy of the rows halves the bytes and makes the
arithmetic of a whole verification batch nearly free, so a batch of ``b`` queries costs
about as much as one (1M x 384, one thread, measured here: about 80 ms for b = 2..8,
95 ms for 16; FAISS's float32 kernels took 117-154 ms for 1 and 330-370 ms for 8-16).

bf16 scores are not exact, so this module never *ranks* with them. It returns, per
query, a candidate set that provably contains the exact top-k of every real row; the
caller re-scores the candidates exactly (float64) and ranks them, so results are the
same bits as a brute-force float64 ranking, whatever the batch or the hardware.

The bound. For a query q and a row x (float32), let s = q.x (exact) and s^ the scan's
value: q and x rounded to bf16 (unit roundoff u = 2^-8), products exact in fp32,
accumulated in fp32 (n = d terms, at most (n-1) 2^-24 relative to sum|q_i x_i|), and the
result rounded to bf16 (another u). With sum|q_i x_i| <= |q| |x| (Cauchy-Schwarz):

    |s^ - s| <= eps(x) = c |q| |x|,   c = SAFETY * (3u + 4u^2 + (n + 2) 2^-24)

For d = 384, c ~ 0.0123: for unit vectors a candidate window of about 0.025.

Selection. Let L = the k-th largest lower bound s^_j - eps_j over any k real rows seen;
then the exact k-th best score s_k >= L. A row can be in the top-k (s_r >= s_k) only if
s^_r + eps_r >= L, so the candidate set {r : s^_r + eps_r >= L} is complete. L only
grows while scanning, so rows filtered out with an earlier (smaller) L stay out.

Worked example (k = 1, c |q| = 0.01, unit rows): s^ = [0.70, 0.695, 0.60] gives lower
bounds [0.69, 0.685, 0.59], L = 0.69, upper bounds [0.71, 0.705, 0.61]: rows 0 and 1 are
candidates (either may be the exact best), row 2 is not.

L2 (KNN-LM datastores): the smallest |q - x|^2 are the largest 2 q.x - |x|^2; the same
bound applies with eps = 2 c |q| |x| + 2^-22 |x|^2 (|x|^2 is stored in float32).

The kernel's accumulation precision is checked at construction (:func:`probe_kernel`):
a kernel that accumulates in bf16 would break the bound, and then :func:`available`
says no and callers keep their float32 path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ralm.retrieval.scan_bounds import CandidateTracker, query_matrix, trivial_candidates

log = logging.getLogger(__name__)

U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
U_FP32 = 2.0**-24
SAFETY = 1.05  # covers the float32 arithmetic of the bound itself
BLOCK_ROWS = 1 << 14  # rows per matrix product: 16384 x 384 bf16 = 12 MiB
ABS_SLACK = 1e-12  # float64 re-scoring vs real arithmetic, denormal flushing

_probe_lock = threading.Lock()
_probe_result: bool | None = None


def bound_constant(dim: int) -> float:
    """c in |s^ - s| <= c |q| |x| for a d-dimensional bf16 scan with fp32 accumulation."""
    u = U_BF16
    return SAFETY * (3 * u + 4 * u * u + (dim + 2) * U_FP32)


def _raw_scores(rows, queries):
    """bf16 (B, d) x (b, d) -> (B, b) bf16 scan scores (the one kernel used)."""
    import torch

    return torch.nn.functional.linear(rows, queries)


def _scores(rows, queries):
    """:func:`_raw_scores` as float32 (exact conversion)."""
    return _raw_scores(rows, queries).float()


def probe_kernel() -> bool:
    """True when torch's bf16 matrix product accumulates in float32 on this machine.

    q = ones, x = [1, 2^-9, ..., 2^-9] (all exact in bf16): the exact dot product is
    1 + 383 * 2^-9 = 1.748; a bf16 accumulator stays at 1.0 (2^-9 is below half an ulp
    of 1), far outside the bound c |q| |x| ~ 0.24.
    """
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        try:
            import torch

            d = 384
            q = torch.ones(2, d, dtype=torch.bfloat16)
            x = torch.full((8, d), 2.0**-9, dtype=torch.bfloat16)
            x[:, 0] = 1.0
            got = _scores(x, q).double().numpy()
            exact = 1.0 + (d - 1) * 2.0**-9
            xn = np.sqrt(1.0 + (d - 1) * 2.0**-18)
            ok = bool(np.all(np.abs(got - exact) <= bound_constant(d) * np.sqrt(d) * xn))
        except Exception as exc:  # no torch, no bf16 kernel
            log.info("bf16 scan unavailable: %s", exc)
            ok = False
        _probe_result = ok
        return ok


# oneDNN ISA caps below AVX512-BF16: with one set (to emulate an older CPU), bf16 is emulated
_NO_BF16_ISAS = {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni"}


def hardware_bf16() -> bool:
    """The CPU has bf16 matrix/dot-product instructions (AMX or AVX512-BF16) and they are
    not capped away (``ONEDNN_MAX_CPU_ISA=AVX2`` makes this False, as on an AVX2 CPU)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower() in _NO_BF16_ISAS:
        return False
    try:
        import torch

        cpu = torch.cpu
        return bool(
            getattr(cpu, "_is_amx_tile_supported", lambda: False)()
            or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
        )
    except Exception:
        return False


def available(mode: str = "auto") -> bool:
    """Whether to use the bf16 scan: 'bf16' forces it (if the kernel is sound), 'faiss' and
    'int8' never, 'auto' when the CPU has bf16 instructions (else bf16 is emulated, slow)."""
    if mode not in ("auto", "bf16"):
        return False
    if mode == "auto" and not hardware_bf16():
        return False
    if not probe_kernel():
        if mode == "bf16":
            raise RuntimeError(
                "dense_scan='bf16' but torch's bf16 matrix product does not "
                "accumulate in float32 on this machine; use 'faiss'"
            )
        return False
    return True


class Bf16Scan:
    """A bf16 copy of a flat KB (real rows, then padding rows) and its candidate search.

    ``rows``: (n_real, d) float32, the real rows in id order. ``pad_chunks``: float32
    (m, d) chunks appended after them (never returned; they only cost scan time).
    ``metric``: 'ip' (largest inner product) or 'l2' (smallest squared distance).
    """

    def __init__(
        self,
        rows: np.ndarray,
        pad_chunks: Iterable[np.ndarray] = (),
        *,
        metric: str = "ip",
        pad_rows: int = 0,
        block_rows: int = BLOCK_ROWS,
    ):
        import torch

        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be 'ip' or 'l2', not {metric!r}")
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError("rows must be a non-empty (n, d) array")
        self.metric = metric
        self.n_real, self.dim = rows.shape
        self.n_rows = self.n_real + int(pad_rows)
        self.block_rows = int(block_rows)
        self.c = bound_constant(self.dim)
        data = torch.empty((self.n_rows, self.dim), dtype=torch.bfloat16)  # (N, d)
        for s in range(0, self.n_real, self.block_rows):  # chunked: no full fp32 copy
            e = min(s + self.block_rows, self.n_real)
            data[s:e] = torch.from_numpy(np.array(rows[s:e]))
        at = self.n_real
        for chunk in pad_chunks:
            m = chunk.shape[0]
            data[at : at + m] = torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.float32))
            at += m
        if at != self.n_rows:
            raise ValueError(f"padding chunks gave {at - self.n_real} rows, expected {pad_rows}")
        self.data = data
        norms = np.sqrt(np.einsum("ij,ij->i", rows.astype(np.float64), rows.astype(np.float64)))
        self.row_norm = norms * (1 + 1e-6)  # (n_real,) float64, rounded up
        self.sq_norm = torch.from_numpy((norms**2).astype(np.float32))  # (n_real,) |x|^2
        # per block, over its real rows (padding rows are never candidates): the largest
        # norm (the block's error bound) and the smallest/largest |x|^2 (the l2 fast path)
        sq = norms**2
        starts = range(0, self.n_rows, self.block_rows)
        real = [(s, min(s + self.block_rows, self.n_real)) for s in starts]
        self.block_norm = [float(self.row_norm[a:b].max()) if a < b else 0.0 for a, b in real]
        self.block_sqmin = [float(sq[a:b].min()) if a < b else 0.0 for a, b in real]
        self.block_sqmax = [float(sq[a:b].max()) if a < b else 0.0 for a, b in real]

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() * 2)

    @property
    def label(self) -> str:
        """For report headers."""
        return "bf16"

    def _eps(self, qn: np.ndarray, xn: np.ndarray | float) -> np.ndarray:
        """Error bound(s) of the transformed score for query norms ``qn``, row norms ``xn``."""
        if self.metric == "ip":
            return self.c * qn * xn + ABS_SLACK * (1 + qn * qn + np.square(xn))
        return 2 * self.c * qn * xn + 2.0**-22 * np.square(xn) + ABS_SLACK * (1 + qn * qn + np.square(xn))

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per query, sorted real row ids that contain its exact top-``k``.

        ``queries``: (b, d) float32. Costs one pass over the bf16 rows for the batch.
        """
        import torch

        Q = query_matrix(queries, self.dim)  # (b, d)
        b, k = Q.shape[0], int(k)
        done = trivial_candidates(b, k, self.n_real)
        if done is not None:
            return done
        qn = np.sqrt(np.einsum("ij,ij->i", Q.astype(np.float64), Q.astype(np.float64))) * (1 + 1e-6)
        Qb = torch.from_numpy(Q).to(torch.bfloat16)
        if b == 1:
            Qb = Qb.expand(2, self.dim).contiguous()  # the b >= 2 kernel is faster than b = 1
        alpha, beta = (1.0, 0.0) if self.metric == "ip" else (2.0, 1.0)
        track = CandidateTracker(b, k)
        for bi, start in enumerate(range(0, self.n_rows, self.block_rows)):
            stop = min(start + self.block_rows, self.n_rows)
            raw = _raw_scores(self.data[start:stop], Qb)  # (B, b') bf16
            real = max(0, min(stop, self.n_real) - start)
            if real == 0:
                # padding only: it can never be a candidate (its ids are not returned)
                continue
            raw = raw[:real, :b]
            eps_blk = self._eps(qn, self.block_norm[bi])  # (b,) float64
            L = track.L
            if bi > 0 and np.isfinite(L).all():
                # Fast path: select on the bf16 scores, convert only the survivors (on
                # real rows, converting and testing whole blocks in float32 cost as much
                # as the product). A row can pass the exact test below only if
                # alpha s^ - |x|^2 >= L - eps, i.e. s^ >= (L - eps + beta min|x|^2) / alpha;
                # the limit is lowered by a margin covering its bf16 rounding (2^-9
                # relative) and the float32 arithmetic of the exact test, so no row that
                # the exact test would keep is skipped.
                lim = (L - eps_blk + beta * self.block_sqmin[bi]) / alpha
                lim = lim - 2.0**-7 * (np.abs(lim) + np.abs(L) + beta * self.block_sqmax[bi] + 1e-30)
                lim_b = torch.from_numpy(lim.astype(np.float32)).to(torch.bfloat16)
                rows_i, cols_i = torch.nonzero(raw >= lim_b, as_tuple=True)
                if rows_i.numel() == 0:
                    continue
                v = raw[rows_i, cols_i].float()  # (m,) float32
                if beta:
                    v = alpha * v - self.sq_norm[start + rows_i]
                thr = torch.from_numpy((L - eps_blk).astype(np.float32))  # (b,)
                ok = v >= thr[cols_i]  # the same float32 test as below
                rows_i, cols_i, v = rows_i[ok], cols_i[ok], v[ok]
                if rows_i.numel() == 0:
                    continue
            else:
                S = raw.float()  # (real, b) float32
                if beta:
                    S = alpha * S - self.sq_norm[start : start + real, None]
                if bi == 0:
                    # initialise L from this block's k best lower bounds (real rows only)
                    kk = min(k, real)
                    if kk == k:
                        top = torch.topk(S, kk, dim=0).values.double().numpy()  # (k, b)
                        track.raise_floor(top[-1] - eps_blk)
                thr = torch.from_numpy((track.L - eps_blk).astype(np.float32))  # (b,)
                rows_i, cols_i = torch.nonzero(S >= thr, as_tuple=True)
                if rows_i.numel() == 0:
                    continue
                v = S[rows_i, cols_i]
            rows_np = rows_i.numpy().astype(np.int64) + start
            cols_np = cols_i.numpy()
            vals = v.double().numpy()
            track.add(rows_np, cols_np, vals, self._eps(qn[cols_np], self.row_norm[rows_np]))
        return track.result()
