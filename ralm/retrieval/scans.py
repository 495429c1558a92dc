"""The candidate scans of a flat vector table, behind one protocol and one name -> factory registry.

A *candidate scan* holds a low-precision (or device) copy of a table of rows and answers a
batch of queries with, per query, a set of row ids that provably contains the exact top-k by
the metric ('ip': largest inner product; 'l2': smallest squared distance). The caller re-scores
the candidates exactly, so a scan decides speed, never a result. Padding rows (appended after
the real rows, never returned) make a scan cost what a larger table costs.

Registered scans (:data:`SCANS`): ``bf16`` (:mod:`ralm.retrieval.bf16_scan`; 'ip' and 'l2'),
``int8`` (:mod:`ralm.retrieval.int8_scan`; 'ip') and ``gpu`` (:mod:`ralm.retrieval.device_scan`;
'ip'). Document retrieval chooses among them by timing (:mod:`ralm.retrieval.scan_choice`) and
KNN-LM with its metric ('l2', :mod:`ralm.knnlm.retriever`); both build through :func:`make_scan`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ralm.retrieval import bf16_scan, device_scan, int8_scan

__all__ = [
    "SCANS",
    "CandidateScan",
    "ScanKind",
    "first_available",
    "make_scan",
    "register_scan",
    "scan_kind",
    "scans_for",
]


@runtime_checkable
class CandidateScan(Protocol):
    """What every candidate scan provides."""

    n_real: int  # real rows (ids 0..n_real-1), the only ones ever returned
    n_rows: int  # rows scanned: real rows, then padding rows

    @property
    def label(self) -> str:
        """For report headers: 'bf16', 'int8 +-127 fbgemm', 'fp16 on cuda:0'."""

    def candidates(self, queries: np.ndarray | Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per query, sorted real row ids that contain its exact top-``k`` (one pass for the batch)."""


@dataclass(frozen=True)
class ScanKind:
    """A registered scan: its ``metrics``, its ``build(rows, pad_chunks, pad_rows, metric,
    **options)`` and ``available(mode, dim)`` (whether ``mode`` - the scan's own name, forcing
    it, or 'auto' - may use it here; forcing one that cannot run exactly raises)."""

    name: str
    metrics: tuple[str, ...]
    build: Callable[..., CandidateScan]
    available: Callable[[str, int], bool]


SCANS: dict[str, ScanKind] = {}


def register_scan(kind: ScanKind) -> ScanKind:
    """Add ``kind`` to :data:`SCANS` under its name."""
    SCANS[kind.name] = kind
    return kind


def scan_kind(name: str) -> ScanKind:
    """The registered scan ``name`` (a ``ValueError`` names the registered ones otherwise)."""
    try:
        return SCANS[name]
    except KeyError:
        raise ValueError(f"unknown scan {name!r}: registered scans are {', '.join(SCANS)}") from None


def scans_for(metric: str) -> tuple[str, ...]:
    """The registered scans that rank by ``metric``, in registration order."""
    return tuple(n for n, s in SCANS.items() if metric in s.metrics)


def make_scan(
    name: str,
    rows: np.ndarray,
    pad_chunks: Iterable[np.ndarray] = (),
    *,
    pad_rows: int = 0,
    metric: str = "ip",
    **options: Any,
) -> CandidateScan:
    """Build the scan ``name`` over ``rows`` ((n, d) float32, in id order), then ``pad_rows``
    padding rows from ``pad_chunks``. ``options``: the scan's own (``int8_kernel``)."""
    s = scan_kind(name)
    if metric not in s.metrics:
        raise ValueError(f"the {name} scan ranks by {', '.join(s.metrics)}, not {metric!r}")
    return s.build(rows, pad_chunks, pad_rows=pad_rows, metric=metric, **options)


def _bf16(rows, pad_chunks, *, pad_rows: int, metric: str, **_: Any) -> CandidateScan:
    return bf16_scan.Bf16Scan(rows, pad_chunks, metric=metric, pad_rows=pad_rows)


def _int8(rows, pad_chunks, *, pad_rows: int, metric: str, int8_kernel: str | None = None, **_: Any) -> CandidateScan:
    return int8_scan.Int8Scan(rows, pad_chunks, pad_rows=pad_rows, kernel=int8_kernel, metric=metric)


def _gpu(rows, pad_chunks, *, pad_rows: int, metric: str, **_: Any) -> CandidateScan:
    return device_scan.DeviceScan(rows, pad_chunks, pad_rows=pad_rows, device=device_scan.default_device())


def _gpu_available(mode: str, dim: int) -> bool:
    if mode != "gpu":  # an explicit choice only: the index then takes GPU memory
        return False
    device_scan.default_device()  # raises when this process sees no CUDA device
    return True


register_scan(ScanKind("bf16", ("ip", "l2"), _bf16, lambda mode, dim: bf16_scan.available(mode)))
register_scan(ScanKind("int8", ("ip", "l2"), _int8, int8_scan.available))
register_scan(ScanKind("gpu", ("ip",), _gpu, _gpu_available))


def first_available(mode: str, metric: str, dim: int) -> str | None:
    """The scan ``mode`` picks for ``metric`` without timing: 'faiss' none, a registered scan's
    name that scan (raising where it cannot run exactly here), 'auto' the first registered scan
    for ``metric`` that may run here (None: FAISS)."""
    if mode == "faiss":
        return None
    if mode != "auto":
        s = scan_kind(mode)
        if metric not in s.metrics:
            raise ValueError(f"the {mode} scan ranks by {', '.join(s.metrics)}, not {metric!r}")
        return mode if s.available(mode, dim) else None
    return next((n for n in scans_for(metric) if SCANS[n].available("auto", dim)), None)
