"""Exact integer matrix products for the int8 scan: torch's ``_int_mm`` and FBGEMM.

The int8 scan (:mod:`ralm.retrieval.int8_scan`) needs, per block of row codes ``X~``
(B, d) and a batch of query codes ``Q~`` (b, d), the integer scores ``X~ Q~^T`` (B, b),
*exactly*. Two kernels in a stock torch build can give them, and their speed differs by
CPU:

* ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32). Fast with AVX512-VNNI; on a CPU with
  AVX2 only it was measured about linear in the batch (19 ms at batch 1 and 329 ms at batch
  16 per 65,536 x 384 rows on a 2-core AMD EPYC).
* ``fbgemm``: FBGEMM's int8 GEMM, reached through torch's dynamically quantised linear
  layer (``torch.ops.quantized.linear_dynamic``), which has AVX2 and AVX-512 kernels. The
  row codes are its weight (qint8, scale 1, zero point 0); the queries are its float input,
  which it quantises per call with a scale and zero point taken from the input's range. One
  *anchor* row holding -64 and 63 pins that range: with ``reduce_range`` (7-bit inputs,
  0..127) the scale is 127 / 127 = 1 and the zero point 64, so every query code ``c`` in
  [-63, 63] becomes the integer ``c + 64`` unchanged, the kernel subtracts ``64 x`` the
  weight's column sums in int32, and the float output is the integer score, exact while it
  stays below 2^24. Measured on the same AVX2 EPYC: 2.8 ms at batch 1 and 10 ms at 16 per
  65,536 rows, 7x and 33x faster than ``int_mm``.

Neither kernel is trusted: :func:`exact_levels` checks each against an int64 product on
worst-case signs at the index's own dimension (pair sums that saturate int16, as AVX2's
``vpmaddubsw`` does, sums beyond float32's integers) and returns the code levels at which it
is exact, or None. A kernel that fails is never used.

Worked example (fbgemm, d = 2): rows codes (127, -64); query codes (63, 1); input matrix
[[-64, 63], [63, 1]] (the anchor first); the kernel sees u8 (0, 127) and (127, 65), computes
127 * 127 + 65 * (-64) - 64 * (127 - 64) = 16129 - 4160 - 4032 = 7937 = 63 * 127 + 1 * (-64).
"""

from __future__ import annotations

import logging
import threading
import warnings

import numpy as np

from ralm.retrieval.int8_widths import padded_width

log = logging.getLogger(__name__)

KERNELS = ("fbgemm", "int_mm")  # tried in this order where nothing was timed
ANCHOR = (-64, 63)  # the fbgemm input range that makes its input scale exactly 1
_lock = threading.Lock()
_levels: dict[tuple[str, int], tuple[int, int] | None] = {}  # (kernel, dim) -> (row, query) levels


class IntMM:
    """``torch._int_mm``: rows as they are, queries as a (d, w) int8 matrix padded with zero
    columns to the kernel's cheapest width (:mod:`ralm.retrieval.int8_widths`)."""

    name = "int_mm"
    level_pairs = ((127, 127), (63, 63))  # (row, query) levels, finest first
    pad_widths = True  # False: each batch at its own width (``ralmspec bench costs --scans int8-own-widths``)

    def rows(self, codes):
        """int8 (B, d) row codes -> the operand :meth:`scores` takes (the codes themselves)."""
        return codes

    def queries(self, q_codes: np.ndarray):
        """int8 (b, d) query codes -> int8 (d, w), w >= b."""
        import torch

        b, d = q_codes.shape
        w = padded_width(b, d) if self.pad_widths else b
        qt = torch.zeros((d, w), dtype=torch.int8)
        qt[:, :b] = torch.from_numpy(np.ascontiguousarray(q_codes.T))
        return qt

    def scores(self, rows, queries, b: int):
        """int32 (B, b) integer scores of the first ``b`` query columns."""
        import torch

        return torch._int_mm(rows, queries)[:, :b]


class Fbgemm:
    """FBGEMM through ``torch.ops.quantized.linear_dynamic`` (see the module docstring)."""

    name = "fbgemm"
    level_pairs = ((127, 63),)  # queries at 63: with the zero point they fill 1..127 (7 bits)

    def rows(self, codes):
        """int8 (B, d) row codes -> FBGEMM's packed weight (scale 1, zero point 0)."""
        import torch

        with warnings.catch_warnings():  # torch marks its quantised tensors deprecated
            warnings.simplefilter("ignore")
            w = torch._make_per_tensor_quantized_tensor(codes.contiguous(), 1.0, 0)
            return torch.ops.quantized.linear_prepack(w, None)

    def queries(self, q_codes: np.ndarray):
        """int8 (b, d) query codes -> float32 (b + 1, d): the anchor row, then the codes."""
        import torch

        b, d = q_codes.shape
        x = torch.zeros((b + 1, d), dtype=torch.float32)
        x[0, 0], x[0, 1] = ANCHOR
        x[1:] = torch.from_numpy(q_codes.astype(np.float32))
        return x

    def scores(self, rows, queries, b: int):
        import torch

        out = torch.ops.quantized.linear_dynamic(queries, rows, True)  # (b + 1, B) float32
        return out[1 : b + 1].T.to(torch.int32)


def kernel(name: str) -> IntMM | Fbgemm:
    """A kernel by name ('int_mm', 'fbgemm')."""
    if name == "int_mm":
        return IntMM()
    if name == "fbgemm":
        return Fbgemm()
    raise ValueError(f"unknown int8 kernel {name!r}; expected one of {', '.join(KERNELS)}")


def worst_case(row_level: int, query_level: int, d: int = 384, b: int = 16) -> tuple:
    """int8 rows (64, d) and queries (b, d): random codes plus rows and queries of constant
    and alternating signs at the levels (the largest pair sums and totals a kernel meets)."""
    import torch

    r, q = row_level, query_level
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-r, r + 1, (64, d), dtype=torch.int8, generator=g)
    x = torch.randint(-q, q + 1, (max(b, 4), d), dtype=torch.int8, generator=g)
    a[0], a[1] = r, -r  # d r q: the largest sum the scan can meet
    a[2, ::2], a[2, 1::2] = r, -r
    x[0], x[1] = q, -q
    x[2, ::2], x[2, 1::2] = q, -q
    x[3, ::2], x[3, 1::2] = -q, q
    return a, x[:b].contiguous()


def is_exact(k: IntMM | Fbgemm, rows, queries) -> bool:
    """Whether ``k`` gives ``rows @ queries.T`` (int8 (B, d), (b, d)) exactly."""
    got = k.scores(k.rows(rows), k.queries(queries.numpy()), queries.shape[0])
    return bool((got.long() == rows.long() @ queries.long().T).all())


def exact_levels(name: str, dim: int) -> tuple[int, int] | None:
    """The finest (row level, query level) at which kernel ``name`` is exact for ``dim``
    dimensions, at batch 1 and 16 on worst-case signs (cached per process); None: nowhere
    (or the kernel does not exist in this torch build)."""
    key = (name, int(dim))
    with _lock:
        if key in _levels:
            return _levels[key]
        k = kernel(name)
        found = None
        try:
            for r, q in k.level_pairs:
                if dim < 2 or dim * r * q >= 2**31:
                    continue
                if all(is_exact(k, *worst_case(r, q, dim, b)) for b in (1, 16)):
                    found = (r, q)
                    break
                log.info("int8 kernel %s is not exact at levels %d/%d for %d dims", name, r, q, dim)
        except (RuntimeError, AttributeError, NotImplementedError) as exc:  # not in this build
            log.info("int8 kernel %s unavailable: %s", name, exc)
        _levels[key] = found
        return found


def exact_kernels(dim: int) -> list[str]:
    """The kernels exact here for ``dim``, in :data:`KERNELS` order."""
    return [n for n in KERNELS if exact_levels(n, dim) is not None]


def default_kernel(dim: int) -> str | None:
    """The kernel an untimed int8 scan uses: the first exact one of :data:`KERNELS`."""
    got = exact_kernels(dim)
    return got[0] if got else None
