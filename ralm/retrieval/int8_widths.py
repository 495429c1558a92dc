"""Query-batch widths for the int8 scan's matrix product, measured on this machine.

The int8 scan (:mod:`ralm.retrieval.int8_scan`) multiplies each block of rows by the batch's
query codes, ``(B, d) x (d, b)``. The kernel's cost is not monotone in ``b``. Measured with
``torch._int_mm`` on a 32,768 x 384 block (AMD EPYC, AVX512-VNNI, one thread, ms):

=====  ====  ====  ====  ====  ====  ====  ====  ====  ====  ====  ====
b       1     2     3     4     7     8     9     12    15    16    32
ms      0.21  1.34  2.15  1.28  3.08  1.31  2.25  2.20  4.15  1.36  2.28
=====  ====  ====  ====  ====  ====  ====  ====  ====  ====  ====  ====

Widths that are powers of two cost about the same, and others cost about one such product
per set bit (15 = 8 + 4 + 2 + 1: four). At 4M rows a verification of 10 queries took 0.42 s
and one of 16 took 0.33 s. So the scan pads a batch with zero query columns up to the
cheapest measured width at or above it (15 -> 16), and drops those columns' scores. Integer
products are exact: a real column's scores are the same bits whatever the padding.

The widths are probed once per process and dimension (about 50 ms): other CPUs' kernels
(AVX2, AMX) have other shapes. A batch takes the smallest probed width at or above it whose
cost is within 1 / :data:`GAIN` of the cheapest such width. Beyond :data:`PROBE_MAX` a batch is rounded up to
a multiple of :data:`LARGE_MULTIPLE`.
"""

from __future__ import annotations

import functools
import time

PROBE_MAX = 64  # widths probed: 1..16, 24, 32, 48 and 64
PROBE_WIDTHS = tuple(range(1, 17)) + (24, 32, 48, PROBE_MAX)
PROBE_ROWS = 8192  # rows of the probe block
GAIN = 0.9  # widths within 1/GAIN of the cheapest at or above a batch count as equal; the smallest is taken
LARGE_MULTIPLE = 32


@functools.lru_cache(maxsize=8)
def width_table(dim: int) -> tuple[int, ...]:
    """``table[b]`` (b = 1..PROBE_MAX): the width a batch of ``b`` queries runs at."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-63, 64, (PROBE_ROWS, dim), dtype=torch.int8, generator=g)
    cost: dict[int, float] = {}
    for w in PROBE_WIDTHS:
        q = torch.randint(-63, 64, (dim, w), dtype=torch.int8, generator=g)
        torch._int_mm(rows, q)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            torch._int_mm(rows, q)
            best = min(best, time.perf_counter() - t0)
        cost[w] = best
    return choose_widths(cost)


def choose_widths(cost: dict[int, float]) -> tuple[int, ...]:
    """``table[b]`` for b = 1..max(cost) from the measured ``cost`` of each probed width:
    the smallest probed width >= b within 1 / GAIN of the cheapest probed width >= b.

    >>> choose_widths({1: 0.21, 2: 1.34, 3: 2.15, 4: 1.28, 8: 1.31, 16: 1.36})
    (0, 1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16)
    """
    probed = sorted(cost)
    table = [0]
    for b in range(1, probed[-1] + 1):
        options = [w for w in probed if w >= b]
        cheapest = min(cost[w] for w in options)
        table.append(next(w for w in options if cost[w] * GAIN <= cheapest))
    return tuple(table)


def padded_width(b: int, dim: int) -> int:
    """The number of query columns to multiply a batch of ``b`` queries with.

    >>> padded_width(100, 384)  # beyond the probe: the next multiple of 32
    128
    """
    if b <= 1:
        return b
    if b > PROBE_MAX:
        return -(-b // LARGE_MULTIPLE) * LARGE_MULTIPLE
    try:
        return width_table(dim)[b]
    except (RuntimeError, AttributeError):  # no int8 product here (the scan is not used then)
        return b
