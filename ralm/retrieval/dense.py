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
from types import SimpleNamespace
from typing import Any

import numpy as np

from ralm import constants as C
from ralm.retrieval.base import Hit, rank_hits
from ralm.retrieval.scan_choice import SCAN_MODES, plan_scan
from ralm.retrievers import RetrieverEntry, entry

log = logging.getLogger(__name__)

PAD_SEED = 20240917
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


def faiss_installed() -> bool:
    """Whether FAISS can be imported here."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


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


def build_faiss_index(e: RetrieverEntry, vectors: np.ndarray, cfg: Any, progress: bool = False):
    """The FAISS index of kind ``e`` (its :attr:`~ralm.retrievers.RetrieverEntry.new_index`, with
    ``cfg``'s build parameters) over ``vectors``, added in chunks of 10,000 rows."""
    if e.new_index is None:
        raise ValueError(f"not a dense retriever kind: {e.kind!r}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    index = e.new_index(dim, cfg)
    step = max(1, min(n, 10000))
    it = range(0, n, step)
    if progress and n > step:
        from tqdm.auto import tqdm

        it = tqdm(it, total=(n + step - 1) // step, desc=f"building the {e.kind} index", unit="chunk")
    for s in it:
        index.add(vectors[s : s + step])
    return index


class DenseRetriever:
    """A dense retriever of kind ``kind`` (its :class:`~ralm.retrievers.RetrieverEntry`: EDR, a
    flat inner-product index scanned whole, or ADR, an HNSW graph) with exact re-scoring.

    ``index``: a FAISS index over exactly ``vectors`` (built here when ``None``, with the
    entry's index factory). ``pad_to`` (scanned kinds only: edr): pad the flat index with random vectors of norm
    ``PAD_VECTOR_NORM`` up to that many rows, so each search scans as many rows as a
    Wikipedia-scale index; padding rows are never returned and results are identical.
    ``int8_kernel``: the int8 scan's integer product ('fbgemm', 'int_mm'; None: the plan's),
    for side-by-side measurements (``ralmspec bench costs --scans int8:fbgemm,int8:int_mm``).
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
        e = entry(kind)
        if e.new_index is None:
            raise ValueError(f"not a dense retriever kind: {kind!r}")
        if dense_scan not in SCAN_MODES:
            raise ValueError(f"dense_scan must be one of {', '.join(SCAN_MODES)}, not {dense_scan!r}")
        self.name = kind
        self.kind = kind
        self.entry = e
        self.scorer = DenseScorer(encoder, vectors)
        self.encoder = encoder
        self.rerank_margin = int(rerank_margin)
        self.faiss_threads = int(faiss_threads)
        self.n_docs = len(self.scorer)
        # FAISS answers a graph kind and the batches a plan routes to it; a scanned kind on a
        # bf16, int8 or device scan also runs where FAISS is not installed (a bare GPU host),
        # with no index (plan_scan refuses a plan that needs FAISS then)
        if index is None and (not e.scan or dense_scan == "faiss" or faiss_installed()):
            params = SimpleNamespace(hnsw_m=hnsw_m, hnsw_ef_construction=ef_construction)
            index = build_faiss_index(e, self.scorer.vectors, params)
        if index is not None:
            import faiss

            if index.ntotal != self.n_docs or index.d != self.scorer.dim:
                raise ValueError(
                    f"FAISS index has {index.ntotal} rows of dim {index.d}, "
                    f"vectors are {self.n_docs} x {self.scorer.dim}"
                )
            hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
            if hnsw is not None:  # a graph index: its search breadth
                hnsw.efSearch = int(ef_search)
                self.ef_search = int(ef_search)
        if pad_to and not e.scan:
            log.warning("pad_to=%d ignored: padding only applies to a scanned (flat) retriever", pad_to)
        extra = max(0, int(pad_to) - self.n_docs) if (pad_to and e.scan) else 0
        self.stats: dict[str, int] = {"searches": 0, "expansions": 0}
        # the one candidate scan: its plan routes each batch size to FAISS or the chosen scan
        self.scan = plan_scan(
            dense_scan if e.scan else "faiss",
            self.scorer.vectors,
            index,
            self.scorer.score_ids,
            flat=e.scan,
            pad_rows=extra,
            pad_chunks=lambda n: padding_vectors(n, self.scorer.dim),
            rerank_margin=self.rerank_margin,
            faiss_threads=self.faiss_threads,
            int8_kernel=int8_kernel,
            stats=self.stats,
        )
        self.plan = self.scan.plan
        self.padded_rows = int(pad_to) if extra else 0
        if extra:
            log.warning(
                "%s %s padded to %d rows to emulate a larger knowledge base "
                "(%d real passages + %d random vectors of norm %g; results unchanged)",
                kind.upper(),
                f"{self.dense_scan} scan" if self.scan.low is not None else "index",
                pad_to,
                self.n_docs,
                extra,
                C.PAD_VECTOR_NORM,
            )
        self.index = index
        self.n_rows = self.scan.n_rows

    @property
    def dense_scan(self) -> str:
        """The candidate scan in use: 'faiss' or a registered scan ('bf16', 'int8', 'gpu')."""
        return self.scan.name

    @property
    def batch_cost_curve(self) -> dict[int, float] | None:
        """A batch's cost relative to one query by batch size, as timed at start-up (a scanned
        kind with a timed plan only; see :meth:`ScanPlan.cost_curve`)."""
        return self.plan.cost_curve() if self.entry.scan else None

    @property
    def scan_label(self) -> str:
        """The paths in use for report headers: the scan's label with the int8 code levels
        and kernel ('int8 +-127/63 fbgemm'), and the batch sizes FAISS answers when it answers some
        ('faiss at batch 1, int8 +-127 at 2-16')."""
        return self.scan.label

    def __repr__(self) -> str:
        pad = f", padded_rows={self.padded_rows}" if self.padded_rows else ""
        return f"DenseRetriever({self.name!r}, n_docs={self.n_docs}{pad})"

    # ------------------------------------------------------------------ search
    def search_vectors(self, query_reps: Sequence[np.ndarray], k: int) -> list[list[Hit]]:
        """Top-``k`` for already encoded queries: one candidate scan for the batch (its
        candidate sets provably contain the exact top-k), then exact float64 re-scoring."""
        if k <= 0 or len(query_reps) == 0:
            return [[] for _ in query_reps]
        Q = np.stack([np.asarray(q, dtype=np.float32) for q in query_reps])
        cands = self.scan.candidates(Q, k)
        self.stats["searches"] += len(query_reps)
        self.stats["candidates"] = self.stats.get("candidates", 0) + int(sum(c.size for c in cands))
        return [rank_hits(ids, self.scorer.score_ids(Q[i], ids), k) for i, ids in enumerate(cands)]

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.scorer.encode(queries), k)
