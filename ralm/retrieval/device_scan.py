"""Exact top-k candidates from a float16 scan on an accelerator, with a proven error bound.

On a GPU the flat scan is cheap: a 4M x 384 float16 copy is 3 GB, read at terabytes per
second, and a verification batch of 16 costs about what one query does. As with the CPU
scans (:mod:`ralm.retrieval.bf16_scan`, :mod:`ralm.retrieval.int8_scan`), the device never
ranks anything: per query it returns a candidate set that provably contains the exact top-k,
and the caller re-scores the candidates exactly (float64, on the host).

The bound. Rows are stored as ``x~ = fp16(x)`` (round to nearest); the residual
``r_x = |x - x~|`` is computed exactly on the host at build time (float64, rounded up). The
query stays float32, each block is converted to float32 (exact) and multiplied in float32
with float32 accumulation, in any summation order: the computed ``s^`` satisfies
``|s^ - q.x~| <= g |q| |x~|`` with ``g = (d + 1) 2^-24 / (1 - (d + 1) 2^-24)`` (product
roundings and the sum's, Cauchy-Schwarz on ``sum |q_i x~_i|``). With ``|q.x~ - q.x| <= |q| r_x``:

    |s^ - s| <= eps = |q| (r_x + g |x~|)

For unit vectors in 384 dims, ``r_x`` ~ 2^-11 |x| and ``g`` ~ 2.3e-5: a window of about 5e-4,
far narrower than the int8 one. The bound needs float32 accumulation: TF32 tensor cores
(10-bit inputs) or a half-precision accumulator would break it. Two guards:

- the float32 matmul precision torch is set to (``torch.backends.cuda.matmul.fp32_precision``,
  or the legacy ``allow_tf32`` / ``set_float32_matmul_precision``) is read on every call, not
  once per process: while it is anything but IEEE (TF32 turned on after the scan was built,
  say), the call multiplies in float64 instead, which no such setting touches and whose error
  is far inside the bound;
- :func:`probe` checks the device's IEEE float32 product (cached per device), and the scan
  refuses a device that fails.

Selection is :class:`~ralm.retrieval.scan_bounds.CandidateTracker`'s, as in the int8 scan:
per block the device keeps the entries that can still reach the running k-th lower bound
(a comparison and a ``nonzero`` on the device), and only those cross to the host. The first
block sets that floor on the device: each entry's lower bound ``s^ - eps`` in float64 (the
host's formula, operation for operation), the k-th largest per query (``topk``), so only the
entries that can reach it cross, not every score of the block (0.4 GB per call at batch 16
and 1M-row blocks). An entry dropped there has ``s^ + eps`` below a floor the final one
can only raise, so the host would have dropped it at the end anyway: the candidates are the
same.

Worked example (d = 2): x = (0.1, 0.3) (float32), x~ = (0.0999756, 0.3000488), r_x = 5.46e-5,
g = 1.8e-7; q = (1, 1): s = 0.4000000, q.x~ = 0.4000244, eps = 1.4142 (5.46e-5 + 1.8e-7 *
0.316) = 7.7e-5 >= |0.4000244 - 0.4000000| = 2.4e-5.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ralm.retrieval.scan_bounds import CandidateTracker, query_matrix, trivial_candidates

log = logging.getLogger(__name__)

FP16_MAX = 65504.0
ROUND_UP = 1 + 1e-9  # host norms in float64, rounded up
ABS_SLACK = 1e-12  # float64 arithmetic of the bound and of the re-scoring
BLOCK_ROWS = {"cuda": 1 << 20, "cpu": 1 << 15}  # rows per product (a GPU wants few large calls)
HOST_CHUNK = 1 << 16  # rows converted and measured on the host at a time

_lock = threading.Lock()
_probes: dict[str, bool] = {}


def accumulation_gamma(dim: int) -> float:
    """g in |s^ - q.x~| <= g |q| |x~| for float32 products and sums of ``dim`` terms."""
    n = (dim + 1) * 2.0**-24
    return n / (1 - n)


def _scores(rows, queries):
    """float16 rows (B, d), float32 queries (b, d) -> float32 (B, b) on their device (the one kernel)."""
    import torch

    return torch.nn.functional.linear(rows.float(), queries)


def _scores64(rows, queries):
    """float16 rows (B, d), float32 queries (b, d) -> float64 (B, b): the product no float32
    precision setting changes (used while that setting is not IEEE)."""
    import torch

    return torch.nn.functional.linear(rows.double(), queries.double())


def fp32_matmul_ieee(device_type: str) -> bool:
    """Whether torch's float32 matrix products on ``device_type`` ('cuda', 'cpu') are IEEE
    float32 right now (no TF32, no bfloat16 passes): read on every call."""
    import torch

    backend = torch.backends.cuda.matmul if device_type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    mode = getattr(backend, "fp32_precision", None)
    if mode in (None, "none"):  # set through the legacy API only (or an older torch)
        try:
            if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
                return False
            return torch.get_float32_matmul_precision() == "highest"
        except RuntimeError:  # the legacy and the new API were mixed: assume the worst
            return False
    return mode == "ieee"


def probe(device) -> bool:
    """Whether ``device``'s IEEE float32 product accumulates in float32 (cached per device;
    a call while torch's float32 precision is not IEEE runs, and caches, nothing: the scan
    multiplies in float64 then).

    Two checks in 384 dims, each far outside the bound if it fails: (1) q_i = 1 + 2^-11 +
    2^-12 against rows of ones (TF32 rounds q_i to 10 bits: an error of about d 2^-12 = 0.09);
    (2) ones against x = (1, 2^-12, ..., 2^-12) (a half-precision accumulator keeps 1.0:
    an error of 383 2^-12 = 0.09). The bound allows g |q| |x~|, under 0.01 in both."""
    import torch

    key = str(torch.device(device))
    with _lock:
        if key in _probes:
            return _probes[key]
        try:
            d = 384
            q1 = torch.full((2, d), 1 + 2.0**-11 + 2.0**-12, dtype=torch.float32, device=device)
            x1 = torch.ones((8, d), dtype=torch.float16, device=device)
            x2 = torch.full((8, d), 2.0**-12, dtype=torch.float16, device=device)
            x2[:, 0] = 1.0
            q2 = torch.ones((2, d), dtype=torch.float32, device=device)
            got1 = _scores(x1, q1).double().cpu().numpy()
            got2 = _scores(x2, q2).double().cpu().numpy()
            want1, want2 = d * (1 + 2.0**-11 + 2.0**-12), 1 + (d - 1) * 2.0**-12
            g = accumulation_gamma(d)
            ok = bool(
                np.all(np.abs(got1 - want1) <= g * float(q1[0].double().norm()) * d**0.5)
                and np.all(np.abs(got2 - want2) <= g * d**0.5 * float(x2[0].double().norm()))
            )
        except Exception as exc:  # no such device, no kernel
            log.info("device scan unavailable on %s: %s", key, exc)
            ok = False
        if not fp32_matmul_ieee(torch.device(device).type):
            return ok  # measured under a reduced setting: not the IEEE product's verdict
        _probes[key] = ok
        return ok


def default_device() -> str:
    """The accelerator a ``dense_scan: gpu`` retriever uses: CUDA's current device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("dense_scan='gpu' needs a CUDA device, and this process sees none")
    return f"cuda:{torch.cuda.current_device()}"


class DeviceScan:
    """A float16 copy of a flat inner-product KB on a torch device, and its candidate search
    (the interface of :class:`~ralm.retrieval.int8_scan.Int8Scan`).

    ``rows``: (n_real, d) float32 in id order; ``pad_chunks``: float32 chunks scanned after
    them (never returned); ``device``: a torch device ('cuda:0'; 'cpu' runs the same code)."""

    metric = "ip"

    def __init__(
        self,
        rows: np.ndarray,
        pad_chunks: Iterable[np.ndarray] = (),
        *,
        pad_rows: int = 0,
        device: str = "cuda",
        block_rows: int | None = None,
    ):
        import torch

        self.device = torch.device(device)
        if fp32_matmul_ieee(self.device.type) and not probe(self.device):
            raise RuntimeError(f"the float32 product on {self.device} does not accumulate in float32 (TF32?)")
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError("rows must be a non-empty (n, d) array")
        if not np.all(np.abs(rows) <= FP16_MAX):
            raise ValueError("row values beyond float16's range: use a CPU scan")
        self.n_real, self.dim = rows.shape
        self.n_rows = self.n_real + int(pad_rows)
        self.block_rows = int(block_rows or BLOCK_ROWS.get(self.device.type, BLOCK_ROWS["cuda"]))
        self.gamma = accumulation_gamma(self.dim)
        data = torch.empty((self.n_rows, self.dim), dtype=torch.float16, device=self.device)
        self.xn = np.empty(self.n_real)  # (n_real,) |x~|
        self.resid = np.empty(self.n_real)  # (n_real,) r_x
        for a in range(0, self.n_real, HOST_CHUNK):  # chunked: no float64 copy of the whole index
            x = rows[a : a + HOST_CHUNK]
            # round to nearest in torch (vectorised; numpy's float16 cast is a scalar loop, 10x
            # slower), and the bound factors from the very halves that are stored
            half = torch.from_numpy(x if x.flags.writeable else x.copy()).to(torch.float16)
            x64, h64 = x.astype(np.float64), half.numpy().astype(np.float64)
            self.xn[a : a + len(x)] = np.sqrt(np.einsum("ij,ij->i", h64, h64)) * ROUND_UP
            self.resid[a : a + len(x)] = np.sqrt(np.einsum("ij,ij->i", x64 - h64, x64 - h64)) * ROUND_UP
            data[a : a + len(x)] = half.to(self.device)
        at = self.n_real
        for chunk in pad_chunks:  # padding rows need no bound: sent as float32, rounded on the device
            m = chunk.shape[0]
            data[at : at + m] = torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.float32)).to(self.device)
            at += m
        if at != self.n_rows:
            raise ValueError(f"padding chunks gave {at - self.n_real} rows, expected {pad_rows}")
        self.data = data
        #: the product the last call ran: 'float32' or 'float64' (see the module docstring)
        self.last_product = ""
        #: entries (row, query) the last call sent to the host
        self.last_transferred = 0
        first = min(self.block_rows, self.n_real)  # the first block's bound factors, on the device
        self._xn0 = torch.from_numpy(self.xn[:first]).to(self.device)
        self._resid0 = torch.from_numpy(self.resid[:first]).to(self.device)
        # per block, over its real rows: the largest bound factors (None: padding only)
        self._blocks: list[tuple[float, float] | None] = []
        for s in range(0, self.n_rows, self.block_rows):
            e = min(s + self.block_rows, self.n_real)
            self._blocks.append((float(self.xn[s:e].max()), float(self.resid[s:e].max())) if s < e else None)

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.dim * 2

    @property
    def label(self) -> str:
        """For report headers: 'fp16 on cuda:0'."""
        return f"fp16 on {self.device}"

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per query, sorted real row ids that contain its exact top-``k`` (one pass over the
        device copy for the batch)."""
        import torch

        Q = query_matrix(queries, self.dim)  # (b, d) float32
        b, k = Q.shape[0], int(k)
        done = trivial_candidates(b, k, self.n_real)
        if done is not None:
            return done
        qn = np.sqrt(np.einsum("ij,ij->i", Q.astype(np.float64), Q.astype(np.float64))) * ROUND_UP  # (b,)
        Qd = torch.from_numpy(Q).to(self.device)
        # read per call: TF32 may have been turned on since the scan was built
        ieee = fp32_matmul_ieee(self.device.type) and probe(self.device)
        product = _scores if ieee else _scores64
        self.last_product = "float32" if ieee else "float64"
        self.last_transferred = 0
        track = CandidateTracker(b, k)
        for bi, start in enumerate(range(0, self.n_rows, self.block_rows)):
            s = product(self.data[start : start + self.block_rows], Qd)  # (B, b) on the device
            blk = self._blocks[bi]
            if blk is None:  # padding only: scanned for its cost, never a candidate
                continue
            real = min(start + self.block_rows, self.n_real) - start
            s = s[:real]
            xn_max, r_max = blk
            if bi == 0 and real >= k:  # the floor from the block's k best lower bounds, on the device
                track.raise_floor(self._first_floor(s[:real], qn, k))
            if np.isfinite(track.L).all():
                # a row needs s^ >= L - eps >= L - eps_blk; the float32 limit is rounded down
                T = (track.L - qn * (r_max + self.gamma * xn_max) - ABS_SLACK).astype(np.float32)
                T = np.nextafter(T, np.float32(-np.inf))
                rows_i, cols_i = torch.nonzero(s >= torch.from_numpy(T).to(self.device), as_tuple=True)
            else:  # the first block: every entry, and the floor from its k best lower bounds
                rows_i, cols_i = torch.nonzero(torch.ones_like(s, dtype=torch.bool), as_tuple=True)
            if rows_i.numel() == 0:
                continue
            self.last_transferred += int(rows_i.numel())
            vals = s[rows_i, cols_i].double().cpu().numpy()
            r_np = rows_i.cpu().numpy().astype(np.int64)
            c_np = cols_i.cpu().numpy()
            ids = r_np + start
            eps = qn[c_np] * (self.resid[ids] + self.gamma * self.xn[ids]) + ABS_SLACK
            track.add_block(r_np, c_np, vals, eps, real, start)
        return track.result()

    def _first_floor(self, s, qn: np.ndarray, k: int) -> np.ndarray:
        """(b,) the k-th largest lower bound ``s^ - eps`` per query over the first block's
        real rows ``s`` (B, b), computed on the device in float64 with the host's formula."""
        import torch

        qd = torch.from_numpy(qn).to(self.device)
        eps = qd[None, :] * (self._resid0[: s.shape[0], None] + self.gamma * self._xn0[: s.shape[0], None]) + ABS_SLACK
        lower = s.double() - eps
        return torch.topk(lower, k, dim=0).values[k - 1].cpu().numpy()
