"""Dense KB retrievers: EDR (FAISS flat inner product) and ADR (FAISS HNSW).

Both generate candidates with FAISS and re-score them exactly with
:func:`dense_scores`, the one scoring function shared with the local speculative
cache (:mod:`cache.speculative`).

:func:`dense_scores` computes float64 inner products with a *fixed* summation tree:
each product of two float32 numbers is exact in float64, and the 384 (or d) products
are summed pairwise by halving (zero-padded to a power of two) with elementwise numpy
adds. Every row is therefore computed by the same sequence of IEEE operations, whatever
the number of rows, their memory layout, the BLAS library or the SIMD width: the KB
re-scorer and the cache get the same bits for the same (query, document), on any
machine. (A BLAS ``gemv`` does not promise this: its blocking can change the
summation order of a row with the matrix shape.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from ralm import constants as C
from ralm.retrieval import bf16_scan, device_scan, int8_scan
from ralm.retrieval.base import Hit, rank_hits
from ralm.retrieval.faiss_search import faiss_search
from ralm.retrieval.int8_scan import Int8Scan
from ralm.retrieval.rerank import Candidates, exact_top_k
from ralm.retrieval.scan_choice import SCANS, ScanPlan, plan_scan

log = logging.getLogger(__name__)

PAD_SEED = 20240917
DENSE_SCANS = SCANS  # the candidate scans of a flat (edr) index (ralm.retrieval.scan_choice)
_PAD_CHUNK = 1 << 16


def dense_scores(keys: np.ndarray | Sequence[np.ndarray], query: np.ndarray) -> np.ndarray:
    """Exact, layout-independent float64 inner products of ``query`` with each key row.

    ``keys``: (n, d) array or a sequence of (d,) vectors (float32 or float64);
    ``query``: (d,) vector. Returns float64 (n,).
    """
    K = np.asarray(keys, dtype=np.float64)
    if K.ndim == 1:
        K = K[None, :]
    q = np.asarray(query, dtype=np.float64).reshape(-1)
    if K.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    if K.shape[1] != q.shape[0]:
        raise ValueError(f"key dimension {K.shape[1]} != query dimension {q.shape[0]}")
    prod = K * q  # exact for float32 inputs (48-bit products)
    d = prod.shape[1]
    width = 1 << max(0, (d - 1).bit_length())
    if width != d:
        prod = np.concatenate([prod, np.zeros((prod.shape[0], width - d))], axis=1)
    while width > 1:
        width //= 2
        prod = prod[:, :width] + prod[:, width:]
    return prod[:, 0].copy()


def dense_score_fn(query_rep: np.ndarray, keys: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    """``dense_scores`` with the ExactScorer argument order: a picklable pure function."""
    return dense_scores(keys, query_rep)


class DenseScorer:
    """ExactScorer for dense KBs: key = the passage's float32 vector; score = :func:`dense_scores`."""

    def __init__(self, encoder: Any, vectors: np.ndarray):
        self.encoder = encoder
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2:
            raise ValueError("vectors must be a 2-D array (n_docs, dim)")
        vectors.setflags(write=False)
        self.vectors = vectors

    def clear_caches(self) -> None:
        """Forget memoised query encodings."""
        clear = getattr(self.encoder, "clear_memo", None)
        if clear is not None:
            clear()

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return int(self.vectors.shape[0])

    def encode(self, queries: Sequence[str]) -> list[np.ndarray]:
        return self.encoder.encode_queries(list(queries))

    def doc_keys(self, doc_ids: Sequence[int]) -> list[np.ndarray]:
        return [self.vectors[int(i)] for i in doc_ids]

    def key_matrix(self, doc_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Keys of ``doc_ids`` stacked as an (n, dim) float32 array."""
        return self.vectors[np.asarray(doc_ids, dtype=np.int64)]

    def score_function(self):
        """The pure scoring function ``(query_rep, keys) -> float64 scores`` (picklable)."""
        return dense_score_fn

    def score(self, query_rep: np.ndarray, keys: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
        return dense_score_fn(query_rep, keys)

    def score_ids(self, query_rep: np.ndarray, doc_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return dense_scores(self.key_matrix(doc_ids), query_rep)


def padding_vectors(
    n_rows: int, dim: int, seed: int = PAD_SEED, norm: float = C.PAD_VECTOR_NORM, chunk: int = _PAD_CHUNK
):
    """Yield float32 chunks (at most ``chunk`` rows) of random-direction vectors of norm
    ``norm``: the padding rows of a flat KB (fixed seed, so every index padded to the same
    size holds the same rows; lazy, so a bf16 scan needs no float32 copy of them)."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < n_rows:
        m = min(int(chunk), n_rows - done)
        x = rng.standard_normal((m, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        x *= np.float32(norm)
        yield x
        done += m


def build_faiss_index(
    kind: str,
    vectors: np.ndarray,
    hnsw_m: int = C.HNSW_M,
    ef_construction: int = C.HNSW_EF_CONSTRUCTION,
    progress: bool = False,
):
    """A FAISS index over ``vectors``: IndexFlatIP (edr) or IndexHNSWFlat/IP (adr)."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    index: faiss.Index
    if kind == "edr":
        index = faiss.IndexFlatIP(dim)
    elif kind == "adr":
        hnsw = faiss.IndexHNSWFlat(dim, int(hnsw_m), faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = int(ef_construction)
        index = hnsw
    else:
        raise ValueError(f"not a dense retriever kind: {kind!r}")
    step = max(1, min(n, 10000)) if kind == "adr" else max(1, n)
    it = range(0, n, step)
    if progress and kind == "adr":
        from tqdm.auto import tqdm

        it = tqdm(it, total=(n + step - 1) // step, desc="building HNSW", unit="chunk")
    for s in it:
        index.add(vectors[s : s + step])
    return index


class DenseRetriever:
    """EDR (``kind="edr"``, flat IP) or ADR (``kind="adr"``, HNSW IP) with exact re-scoring.

    ``index``: a FAISS index over exactly ``vectors`` (built here when ``None``).
    ``pad_to`` (edr only): pad the flat index with random vectors of norm
    ``PAD_VECTOR_NORM`` up to that many rows, so each search scans as many rows as a
    Wikipedia-scale index; padding rows are never returned and results are identical.
    ``int8_kernel``: the int8 scan's integer product ('fbgemm', 'int_mm'; None: the plan's),
    for side-by-side measurements (``ralmspec costs --scans int8:fbgemm,int8:int_mm``).
    """

    def __init__(
        self,
        kind: str,
        encoder: Any,
        vectors: np.ndarray,
        index: Any = None,
        *,
        hnsw_m: int = C.HNSW_M,
        ef_construction: int = C.HNSW_EF_CONSTRUCTION,
        ef_search: int = C.HNSW_EF_SEARCH,
        pad_to: int = 0,
        rerank_margin: int = C.RERANK_MARGIN,
        faiss_threads: int = C.FAISS_THREADS,
        dense_scan: str = "auto",
        int8_kernel: str | None = None,
    ):
        import faiss

        if kind not in ("edr", "adr"):
            raise ValueError(f"not a dense retriever kind: {kind!r}")
        if dense_scan not in DENSE_SCANS:
            raise ValueError(f"dense_scan must be one of {', '.join(DENSE_SCANS)}, not {dense_scan!r}")
        self.name = kind
        self.kind = kind
        self.scorer = DenseScorer(encoder, vectors)
        self.encoder = encoder
        self.rerank_margin = int(rerank_margin)
        self.faiss_threads = int(faiss_threads)
        self.n_docs = len(self.scorer)
        if index is None:
            index = build_faiss_index(kind, self.scorer.vectors, hnsw_m, ef_construction)
        if index.ntotal != self.n_docs or index.d != self.scorer.dim:
            raise ValueError(
                f"FAISS index has {index.ntotal} rows of dim {index.d}, vectors are {self.n_docs} x {self.scorer.dim}"
            )
        self.padded_rows = 0
        self.scan: bf16_scan.Bf16Scan | int8_scan.Int8Scan | device_scan.DeviceScan | None = None
        extra = max(0, int(pad_to) - self.n_docs) if (pad_to and kind == "edr") else 0
        self.plan = (
            plan_scan(dense_scan, self.scorer.dim, self.faiss_threads, max(self.n_docs, int(pad_to or 0)))
            if kind == "edr"
            else ScanPlan("faiss")
        )
        if self.plan.faiss_batches and extra * self.scorer.dim * 4 > C.FAISS_PAD_MAX_BYTES:
            # padding the FAISS index as well would not fit: every batch goes to the scan
            log.warning(
                "dense scan: FAISS routes dropped (padding its index to %d rows would take %.1f GiB)",
                pad_to,
                extra * self.scorer.dim * 4 / 2**30,
            )
            self.plan = ScanPlan(self.plan.scan, (), self.plan.int8_kernel, self.plan.timings)
        chosen = self.plan.scan
        if chosen == "gpu":
            self.scan = device_scan.DeviceScan(
                self.scorer.vectors,
                padding_vectors(extra, self.scorer.dim),
                pad_rows=extra,
                device=device_scan.default_device(),
            )
        elif chosen == "bf16":
            self.scan = bf16_scan.Bf16Scan(self.scorer.vectors, padding_vectors(extra, self.scorer.dim), pad_rows=extra)
        elif chosen == "int8":
            self.scan = int8_scan.Int8Scan(
                self.scorer.vectors,
                padding_vectors(extra, self.scorer.dim),
                pad_rows=extra,
                kernel=int8_kernel or self.plan.int8_kernel,
            )
        elif kind == "adr":
            # an adr index is an HNSW index (build_index, or the caller's own for this kind)
            cast("faiss.IndexHNSW", faiss.downcast_index(index)).hnsw.efSearch = int(ef_search)
            self.ef_search = int(ef_search)
            if pad_to:
                log.warning("pad_to=%d ignored: padding only applies to the edr retriever", pad_to)
        if extra and (chosen == "faiss" or self.plan.faiss_batches):
            # FAISS answers some batches: its index is padded too, so it costs what the scan does
            for chunk in padding_vectors(extra, self.scorer.dim):
                index.add(chunk)
        if extra:
            self.padded_rows = int(pad_to)
            log.warning(
                "EDR %s padded to %d rows to emulate a larger knowledge base "
                "(%d real passages + %d random vectors of norm %g; results unchanged)",
                f"{self.dense_scan} scan" if self.scan is not None else "index",
                pad_to,
                self.n_docs,
                extra,
                C.PAD_VECTOR_NORM,
            )
        self.index = index
        self.n_rows = self.scan.n_rows if self.scan is not None else int(index.ntotal)
        self.stats = {"searches": 0, "expansions": 0}

    @property
    def dense_scan(self) -> str:
        """The candidate scan in use: 'bf16', 'int8', 'gpu' or 'faiss'."""
        if self.scan is None:
            return "faiss"
        if isinstance(self.scan, device_scan.DeviceScan):
            return "gpu"
        return "int8" if isinstance(self.scan, Int8Scan) else "bf16"

    @property
    def batch_cost_curve(self) -> dict[int, float] | None:
        """A batch's cost relative to one query by batch size, as timed at start-up (exact
        dense with a timed plan only; see :meth:`ScanPlan.cost_curve`)."""
        return self.plan.cost_curve() if self.kind == "edr" else None

    @property
    def scan_label(self) -> str:
        """The paths in use for report headers: :attr:`dense_scan` with the int8 code levels
        and kernel ('int8 +-127/63 fbgemm'), and the batch sizes FAISS answers when it answers some
        ('faiss at batch 1, int8 +-127 at 2-16')."""
        name = self.scan.label if isinstance(self.scan, (Int8Scan, device_scan.DeviceScan)) else self.dense_scan
        return self.plan.label(name)

    def __repr__(self) -> str:
        pad = f", padded_rows={self.padded_rows}" if self.padded_rows else ""
        return f"DenseRetriever({self.name!r}, n_docs={self.n_docs}{pad})"

    # ------------------------------------------------------------------ search
    def _faiss_search(self, Q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.faiss_threads:
            # OpenMP's thread count is per calling thread: set it in *this* thread, which
            # may be an asynchronous-verification worker (else it would use one thread per
            # core next to the generator, and oversubscribed spin-waiting made searches ~6x
            # slower in our measurements).
            import faiss

            faiss.omp_set_num_threads(self.faiss_threads)
        if self.kind == "edr":
            return faiss_search(self.index, Q, n)  # batches on FAISS's BLAS path
        return self.index.search(np.ascontiguousarray(Q, dtype=np.float32), int(n))

    def _candidates(self, D: np.ndarray, I: np.ndarray, n: int) -> Candidates:
        valid = I >= 0
        bound = float(D[valid][-1]) if valid.any() else None
        real = valid & (I < self.n_docs)
        complete = n >= self.n_rows or int(valid.sum()) < n
        return Candidates(ids=I[real].astype(np.int64), bound=bound, complete=complete)

    def _resolve(self, q: np.ndarray, k: int, first: tuple[np.ndarray, np.ndarray] | None) -> list[Hit]:
        n_first = min(k + self.rerank_margin, self.n_rows)

        def candidates(n: int) -> Candidates:
            nonlocal first
            if first is not None and n == n_first:
                D, I = first
                first = None
            else:
                D, I = self._faiss_search(q[None, :], n)
                D, I = D[0], I[0]
            return self._candidates(D, I, n)

        hits, _ = exact_top_k(
            k, n_first, self.n_rows, candidates, lambda ids: self.scorer.score_ids(q, ids), self.stats
        )
        if len(hits) < min(k, self.n_docs):
            # HNSW ran out of candidates (it returns fewer than asked for very large k):
            # rank every document exactly instead
            self.stats["exhaustive"] = self.stats.get("exhaustive", 0) + 1
            hits = rank_hits(np.arange(self.n_docs), self.scorer.score(q, self.scorer.vectors), k)
        return hits

    def search_vectors(self, query_reps: Sequence[np.ndarray], k: int) -> list[list[Hit]]:
        """Top-``k`` for already encoded queries (one batched FAISS call + exact re-scoring)."""
        if k <= 0 or len(query_reps) == 0:
            return [[] for _ in query_reps]
        Q = np.stack([np.asarray(q, dtype=np.float32) for q in query_reps])
        if self.scan is not None and self.plan.route(len(Q)) != "faiss":
            # one bf16 or int8 pass for the whole batch; its candidate sets provably contain
            # the exact top-k, which the float64 re-scoring then ranks (see bf16_scan, int8_scan)
            cands = self.scan.candidates(Q, k)
            self.stats["searches"] += len(query_reps)
            self.stats["candidates"] = self.stats.get("candidates", 0) + int(sum(c.size for c in cands))
            return [rank_hits(ids, self.scorer.score_ids(Q[i], ids), k) for i, ids in enumerate(cands)]
        n_first = min(k + self.rerank_margin, self.n_rows)
        D, I = self._faiss_search(Q, n_first)
        self.stats["searches"] += len(query_reps)
        return [self._resolve(Q[i], k, (D[i], I[i])) for i in range(len(query_reps))]

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.scorer.encode(queries), k)
