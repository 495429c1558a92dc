"""Batch cost curves: what a KB call of ``s`` queries costs relative to one query.

An exact dense KB times its batch sizes at start-up
(:meth:`ralm.retrieval.scan_choice.ScanPlan.cost_curve`, e.g. ``{1: 1.0, 4: 1.3, 16: 3.4}``);
the stride scheduler (:mod:`ralm.stride.os3`) reads such a curve beyond the sizes it has measured
itself, and interpolates its own measured means with the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping


def monotone(curve: Mapping[int, float]) -> dict[int, float]:
    """``curve`` by increasing size, made non-decreasing (a running maximum)."""
    out: dict[int, float] = {}
    top = -float("inf")
    for size in sorted(curve):
        top = max(top, float(curve[size]))
        out[int(size)] = top
    return out


def curve_at(curve: Mapping[int, float], s: float) -> float:
    """A batch cost curve (size -> cost, non-decreasing) at ``s``: linear between its
    sizes, its first value below them, and the last two sizes' slope beyond them.

    >>> round(curve_at({1: 1.0, 4: 1.3, 16: 3.4}, 8), 9), round(curve_at({1: 1.0, 4: 1.3, 16: 3.4}, 20), 9)
    (2.0, 4.1)
    """
    sizes = sorted(curve)
    if s <= sizes[0] or len(sizes) == 1:
        return curve[sizes[0]]
    i = next((j for j, size in enumerate(sizes) if size >= s), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return curve[lo] + (curve[hi] - curve[lo]) * (s - lo) / (hi - lo)


def scaled(curve: Mapping[int, float], size: int, cost: float, s: int) -> float:
    """The cost of a batch of ``s``, given ``cost`` measured at ``size`` and the curve's shape.

    >>> round(scaled({1: 1.0, 4: 1.3, 16: 3.4}, 1, 0.17, 8), 12)
    0.34
    """
    return cost * curve_at(curve, s) / curve_at(curve, size)
