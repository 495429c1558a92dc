"""KB search of the KNN-LM datastore: a candidate stage + exact float64 re-scoring.

Flat index, ``scan='bf16'`` (``'auto'`` picks it when the CPU has bf16 instructions and
torch's bf16 kernel accumulates in float32, :func:`ralm.retrieval.bf16_scan.available`;
otherwise ``'int8'``, :class:`~ralm.retrieval.int8_scan.Int8Scan` with metric 'l2', where an
integer product is exact here, as on AVX2-only CPUs; the same candidate contract):
a bfloat16 copy of the keys (and of the padding rows, generated straight into it - no
float32 copy of the padding) is scanned once per batch by
:class:`~ralm.retrieval.bf16_scan.Bf16Scan` (metric 'l2'), whose candidate set per query
provably contains the exact top-k (its error bound uses each row's own norm; the
keys are hidden states, norms about 13-17 for the demo model, not unit vectors). The
candidates are then narrowed with float32 direct-form distances and a proven relative
error bound (:func:`narrow_candidates`) and the survivors re-scored with the exact
distance. A batch of s queries costs about one pass over the rows, so verification is
nearly flat in s. The rest of this docstring is the FAISS path (``scan='faiss'``, or
no bf16 kernel), which is also the candidate stage of HNSW.

The kernel of :mod:`ralm.retrieval.rerank` (through :func:`exact_knn`): FAISS
(IndexFlatL2 or HNSW, L2) proposes ``k + margin`` candidates, they are re-scored with
the exact distance (:func:`ralm.knnlm.metric.l2_distances`) and ranked by (distance asc,
entry id asc).
Every entry that is not a candidate has a candidate-stage distance at least the last
candidate's (the *bound*); if the exact k-th distance is not clearly below the bound
(within :func:`~ralm.knnlm.metric.tolerance`, which also covers the float32
``|q|^2 + |x|^2 - 2 q.x`` kernel FAISS uses for batches), the candidate set is doubled.
For the flat index the result is exactly the top-k of the exact distance over the
whole datastore, whatever the batch; for HNSW it is a pure function of the query.

Padding (flat only, ``pad_to``): random vectors of norm ``KNN_PAD_NORM_FACTOR`` times the
largest key norm, so each search scans as many rows as a large datastore; their ids
(>= number of entries) are dropped, and a padding row among the candidates proves that
every real entry is a candidate.

Batched search (verification): for ``len(batch) >= blas_min_batch`` the flat index's
rows are scanned once for the whole batch with a float32 matrix product per block of
rows (torch; FAISS's own BLAS path was several times slower on one thread here), so a
batch of s queries costs much less than s single searches. A single query uses FAISS's
direct kernel. The exact re-scoring makes the results the same either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ralm import constants as C
from ralm.knnlm.datastore import Datastore
from ralm.knnlm.metric import Hit, l2_distances, rank_by_distance, tolerance
from ralm.retrieval import scans
from ralm.retrieval.bf16_scan import U_FP32
from ralm.retrieval.rerank import Candidates, exact_top_k

if TYPE_CHECKING:
    import faiss
    import torch

log = logging.getLogger(__name__)
_GEMM_BLOCK = 1 << 16
SCANS = ("auto", "faiss", *scans.scans_for("l2"))  # the candidate scans that rank by squared distance


def narrow_candidates(keys: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """The rows of ``ids`` that can be in the top-``k`` of ``ids`` by the exact distance.

    A cheap float32 pass before the float64 re-scoring. ``d32 = sum((x - q)^2)`` in float32
    (any summation order) is within ``(d + 2) u`` (u = 2^-24) relative of the real squared
    distance R (each term is non-negative: the difference and the square are rounded once
    each, the sum adds at most (d - 1) u of the sum), and the float64 tree distance D of
    :func:`~ralm.knnlm.metric.l2_distances` is within ~1e-15 relative of R; ``eps`` below
    covers both, plus an absolute term for float32 underflow (denormals, or flushed to 0).
    So ``lo = d32 (1 - eps) - a <= D <= d32 (1 + eps) + a = hi``. The k-th smallest
    ``hi`` bounds the k-th exact distance from above, and every row whose ``lo`` exceeds
    it is strictly farther than k other rows: dropping it cannot change the top-k by
    (D asc, id asc). Ties at the k-th distance are kept (their ``lo`` <= D <= bound).

    Example: k = 1, d32 = [4.0, 4.00001, 9.0], eps = 1.6e-5: hi_1 = 4.00007, lo = [3.99994,
    3.99995, 8.9999] -> rows 0 and 1 stay (either may be nearest in float64), row 2 goes.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size <= k:
        return ids
    X = keys[ids]  # (n, d) float32
    diff = X - np.asarray(q, dtype=np.float32)[None, :]
    d32 = np.einsum("ij,ij->i", diff, diff).astype(np.float64)
    if not np.all(np.isfinite(d32)):
        return ids  # no bound: keep them all
    d = X.shape[1]
    eps = 1.25 * (d + 4) * U_FP32
    a = (d + 1) * 2.0**-120
    hi_k = np.partition(d32, k - 1)[k - 1] * (1 + eps) + a
    return ids[d32 * (1 - eps) - a <= hi_k]


def margin_for(k: int, margin: int) -> int:
    return max(int(margin), int(k) // 8)


def exact_knn(
    k: int,
    n_first: int,
    n_max: int,
    candidates,
    rescore,
    scale: float,
    stats: dict | None = None,
    extra_tol: float = 0.0,
) -> tuple[list[Hit], bool]:
    """:func:`~ralm.retrieval.rerank.exact_top_k` for squared L2 distances (ascending, ties
    by entry id), for one query.

    ``candidates(n) -> (ids, bound, complete)`` with ``bound`` the largest candidate-stage
    distance among the rows returned (None if none): every row not returned has a
    candidate-stage distance >= bound that is (up to :func:`~ralm.knnlm.metric.tolerance`
    at ``scale``, plus ``extra_tol``) a lower bound of its exact distance. Returns
    (hits, complete).
    """
    hits, cand = exact_top_k(
        k,
        n_first,
        n_max,
        lambda n: Candidates(*candidates(n)),
        rescore,
        stats,
        descending=False,
        tol=lambda bound: tolerance(bound, scale),
        extra_tol=extra_tol,
    )
    return hits, cand.complete


class KnnRetriever:
    """The KNN-LM knowledge base: ``search_vectors(queries, k)`` -> hits (entry id, distance)."""

    def __init__(
        self,
        datastore: Datastore,
        index: str = "flat",
        *,
        pad_to: int = 0,
        hnsw_ef_search: int = C.HNSW_EF_SEARCH,
        rerank_margin: int = C.KNN_RERANK_MARGIN,
        blas_min_batch: int = 2,
        scan: str = "auto",
    ):
        import faiss

        if scan not in SCANS:
            raise ValueError(f"KNN scan must be one of {SCANS}, not {scan!r}")
        self.ds = datastore
        self.kind = index
        self.rerank_margin = int(rerank_margin)
        self.blas_min_batch = int(blas_min_batch)
        self.n_entries = len(datastore)
        self.padded_rows = 0
        self.scan: scans.CandidateScan | None = None  # flat, a registered scan; None: FAISS
        self.index: faiss.Index | None = None
        if index == "flat":
            extra = max(0, int(pad_to) - self.n_entries) if pad_to else 0
            name = scans.first_available(scan, "l2", datastore.dim)
            if name is not None:  # the scan factory of document retrieval, with this metric
                self.scan = scans.make_scan(
                    name, datastore.keys, datastore.pad_chunks(extra), pad_rows=extra, metric="l2"
                )
            else:
                self.index = datastore.flat_index(pad_to)
            if extra:
                self.padded_rows = int(pad_to)
                log.warning(
                    "KNN flat %s scan padded to %d rows (%d entries + %d far-away random vectors; "
                    "never returned, results unchanged) to emulate a large datastore",
                    self.scan_kind,
                    pad_to,
                    self.n_entries,
                    extra,
                )
        elif index == "hnsw":
            if datastore.hnsw is None:
                raise ValueError("the datastore has no HNSW index: build it with build_hnsw() or hnsw=True")
            if pad_to:
                log.warning("pad_to=%d ignored: padding only applies to the flat KNN index", pad_to)
            self.index = datastore.hnsw
            # the datastore's HNSW index is an IndexHNSWFlat (build_hnsw, or its saved hnsw.faiss)
            cast("faiss.IndexHNSW", faiss.downcast_index(self.index)).hnsw.efSearch = int(hnsw_ef_search)
            self.ef_search = int(hnsw_ef_search)
        else:
            raise ValueError(f"KNN index must be 'flat' or 'hnsw', not {index!r}")
        # exact: the answer is the top-k of every entry by (distance, id), so a top-k is the
        # prefix of any larger top-p (flat); HNSW's answer depends on how many it is asked for
        self.exact = index == "flat"
        self.n_rows = self.scan.n_rows if self.scan is not None else int(self._faiss_index().ntotal)
        self.name = (
            f"knn-{index}"
            + (f"/{self.scan.label}" if self.scan is not None else "")
            + (f"(padded to {self.padded_rows:,})" if self.padded_rows else "")
        )
        self.stats = {"searches": 0, "batches": 0, "expansions": 0, "exhaustive": 0, "candidates": 0, "rescored": 0}
        self.batch_s: dict[int, list] = {}
        self._key_scale = datastore.max_norm**2
        self._xb: torch.Tensor | None = None  # torch view of the flat index rows (batched search)
        self._xb_norms: torch.Tensor | None = None  # their squared norms

    @property
    def scan_kind(self) -> str:
        """The candidate scan in use: the scan's label ('bf16', 'int8 +-127/63 fbgemm') or 'faiss'
        (FAISS also for HNSW)."""
        return self.scan.label if self.scan is not None else "faiss"

    def __repr__(self) -> str:
        return f"KnnRetriever({self.kind!r}, scan={self.scan_kind!r}, entries={self.n_entries}, rows={self.n_rows})"

    # ------------------------------------------------------------------ FAISS
    def _faiss_index(self) -> faiss.Index:
        if self.index is None:
            raise RuntimeError("this KNN retriever scans with bf16: it has no FAISS index")
        return self.index

    def _faiss(self, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        Q = np.ascontiguousarray(Q, dtype=np.float32)
        if self.kind == "flat" and len(Q) >= self.blas_min_batch:
            return self._gemm_search(Q, int(n))
        if self.kind == "hnsw":
            # SearchParametersHNSW exists (swigfaiss) but faiss's type stubs leave it out
            params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
            params.efSearch = max(self.ef_search, int(n))  # HNSW returns at most efSearch rows
            return self._faiss_index().search(Q, int(n), params=params)
        return self._faiss_index().search(Q, int(n))

    def _gemm_search(self, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Flat candidates for a batch: ``|x|^2 - 2 q.x`` by blocks of rows with one float32
        matrix product per block (torch, one pass over the rows for the whole batch),
        keeping the ``n`` smallest; the same candidates as FAISS up to float32 rounding,
        which the exact re-scoring and the boundary rule absorb."""
        import torch

        xb_t, xb_norms = self._xb, self._xb_norms
        if xb_t is None or xb_norms is None:
            import faiss

            # the flat kind's index is the datastore's IndexFlatL2 (Datastore.flat_index)
            flat = cast("faiss.IndexFlat", self._faiss_index())
            xb = faiss.rev_swig_ptr(flat.get_xb(), self.n_rows * self.ds.dim)
            xb_t = self._xb = torch.from_numpy(np.asarray(xb).reshape(self.n_rows, self.ds.dim))
            xb_norms = self._xb_norms = torch.cat(
                [(xb_t[s : s + _GEMM_BLOCK].double() ** 2).sum(1).float() for s in range(0, self.n_rows, _GEMM_BLOCK)]
            )
        q = torch.from_numpy(Q)
        qn = (q.double() ** 2).sum(1).float()[:, None]
        n = min(n, self.n_rows)
        block = max(_GEMM_BLOCK, n)
        ds_, is_ = [], []
        with torch.inference_mode():
            for s in range(0, self.n_rows, block):
                X = xb_t[s : s + block]
                D = torch.addmm(xb_norms[s : s + block][None, :], q, X.T, alpha=-2.0)
                m = min(n, D.shape[1])
                v, i = torch.topk(D, m, dim=1, largest=False, sorted=False)
                ds_.append(v)
                is_.append(i + s)
            D = torch.cat(ds_, 1)
            I = torch.cat(is_, 1)
            v, j = torch.topk(D, n, dim=1, largest=False, sorted=True)
            I = torch.gather(I, 1, j)
            v = torch.clamp(v + qn, min=0.0)
        return v.numpy(), I.numpy().astype(np.int64)

    def _cands(self, D: np.ndarray, I: np.ndarray, n: int):
        valid = I >= 0
        bound = float(D[valid][-1]) if valid.any() else None
        real = valid & (I < self.n_entries)
        complete = n >= self.n_rows or int(valid.sum()) < n or bool((valid & ~real).any())
        return I[real], bound, complete

    def _resolve(self, q: np.ndarray, k: int, first) -> list[Hit]:
        n_first = min(k + margin_for(k, self.rerank_margin), self.n_rows)
        scale = float(np.dot(q.astype(np.float64), q.astype(np.float64))) + self._key_scale

        def candidates(n: int):
            nonlocal first
            if first is not None and n == n_first:
                D, I = first
                first = None
            else:
                D, I = self._faiss(q[None, :], n)
                D, I = D[0], I[0]
            return self._cands(D, I, n)

        def rescore(ids):
            return l2_distances(self.ds.keys[ids], q)

        hits, _ = exact_knn(k, n_first, self.n_rows, candidates, rescore, scale, self.stats)
        if len(hits) < min(k, self.n_entries):
            # HNSW returned fewer candidates than asked: rank every entry exactly instead
            self.stats["exhaustive"] += 1
            hits = rank_by_distance(np.arange(self.n_entries), l2_distances(self.ds.keys, q), k)
        return hits

    # ------------------------------------------------------------------ search
    def search_vectors(self, queries: Sequence[np.ndarray] | np.ndarray, k: int) -> list[list[Hit]]:
        """Top-``k`` entries for each query vector (one batched candidate scan + exact
        re-scoring); each query's answer is independent of the batch it is in.
        ``batch_s[b] = [calls, seconds]`` accumulates the latency by batch size ``b``."""
        t0 = time.perf_counter()
        out = self._search_vectors(queries, k)
        rec = self.batch_s.setdefault(len(out), [0, 0.0])
        rec[0] += 1
        rec[1] += time.perf_counter() - t0
        return out

    def _search_vectors(self, queries: Sequence[np.ndarray] | np.ndarray, k: int) -> list[list[Hit]]:
        if len(queries) == 0:
            return []
        if not 1 <= k <= C.KNN_MAX_K:
            raise ValueError(f"k must be in 1..{C.KNN_MAX_K}, got {k}")
        Q = np.stack([np.asarray(q, dtype=np.float32).reshape(-1) for q in queries])
        if Q.shape[1] != self.ds.dim:
            raise ValueError(f"query dimension {Q.shape[1]} != datastore dimension {self.ds.dim}")
        if self.scan is not None:
            return self._scan_search(Q, k)
        n_first = min(k + margin_for(k, self.rerank_margin), self.n_rows)
        D, I = self._faiss(Q, n_first)
        self.stats["searches"] += len(Q)
        self.stats["batches"] += 1
        return [self._resolve(Q[i], k, (D[i], I[i])) for i in range(len(Q))]

    def _scan_search(self, Q: np.ndarray, k: int) -> list[list[Hit]]:
        """bf16 scan (one pass for the batch; candidates provably contain the exact top-k),
        float32 narrowing, float64 re-scoring and (distance, id) ranking per query."""
        if self.scan is None:  # search() takes this path only with a scan
            raise RuntimeError("no bf16 scan: this KNN retriever searches with FAISS")
        cands = self.scan.candidates(Q, k)
        self.stats["searches"] += len(Q)
        self.stats["batches"] += 1
        out = []
        for q, ids in zip(Q, cands):
            self.stats["candidates"] += int(ids.size)
            ids = narrow_candidates(self.ds.keys, ids, q, k)
            self.stats["rescored"] += int(ids.size)
            out.append(rank_by_distance(ids, l2_distances(self.ds.keys[ids], q) if ids.size else np.zeros(0), k))
        return out

    def search(self, query: np.ndarray, k: int) -> list[Hit]:
        return self.search_vectors([query], k)[0]

    def timed_search(self, queries, k: int) -> tuple[list[list[Hit]], float]:
        t0 = time.perf_counter()
        res = self.search_vectors(queries, k)
        return res, time.perf_counter() - t0


def load_knn_retriever(datastore: Datastore, cfg) -> KnnRetriever:
    """A :class:`KnnRetriever` from a :class:`~ralm.config.KnnLMConfig`."""
    if cfg.index == "hnsw" and datastore.hnsw is None:
        datastore.build_hnsw(cfg.hnsw_m, cfg.hnsw_ef_construction)
    return KnnRetriever(
        datastore,
        cfg.index,
        pad_to=cfg.pad_to,
        hnsw_ef_search=cfg.hnsw_ef_search,
        rerank_margin=cfg.rerank_margin,
        scan=cfg.scan,
    )
