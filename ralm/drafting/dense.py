"""DReSD dense drafting: a datastore of hidden states -> the tokens that followed them.

Keys are the model's final hidden state at position ``t`` (the vector that predicts token
``t+1``); values are tokens ``t+1 .. t+1+N``. Keys are z-score normalised, projected with
PCA (numpy SVD) to ~64 dimensions and L2 normalised, then searched with FAISS inner
product (flat, or HNSW). At decode time the current hidden state fetches candidates;
those whose first value token equals the model's next token become drafts (their
remaining tokens), verified together in one batched forward pass
(:mod:`ralm.drafting.decode`).

Build it from the corpus (teacher-forced passages, :func:`collect_corpus`) or, better,
from the model's own greedy generations on the workload ("in-distribution",
:func:`collect_sequences` over ``[docs][question + generated]`` sequences).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ralm import constants as C
from ralm.doc_kv import docs_past
from ralm.hf_cache import cache_kwargs

if TYPE_CHECKING:
    import faiss


class DenseDatastore:
    def __init__(
        self,
        pca_dim: int = C.DENSE_PCA_DIM,
        value_len: int = C.DENSE_DRAFT_LEN + 1,
        index: str = "flat",
        hnsw_m: int = 32,
    ):
        self.pca_dim, self.value_len, self.index_kind, self.hnsw_m = int(pca_dim), int(value_len), index, hnsw_m
        # the fitted projection (fit or load): z-score mean/std and PCA components
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.components: np.ndarray | None = None
        self.values: np.ndarray | None = None
        self.index: faiss.Index | None = None

    def __len__(self) -> int:
        return 0 if self.values is None else len(self.values)

    # ---------------------------------------------------------------- fitting
    def _pca(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean, std, components) of the fitted projection."""
        if self.mean is None or self.std is None or self.components is None:
            raise RuntimeError("DenseDatastore is not fitted: call fit() or load() first")
        return self.mean, self.std, self.components

    def _fitted_values(self) -> np.ndarray:
        if self.values is None:
            raise RuntimeError("DenseDatastore is not fitted: call fit() or load() first")
        return self.values

    def _fitted_index(self) -> faiss.Index:
        if self.index is None:
            raise RuntimeError("DenseDatastore is not fitted: call fit() or load() first")
        return self.index

    def _project(self, keys: np.ndarray) -> np.ndarray:
        mean, std, components = self._pca()
        z = (np.asarray(keys, dtype=np.float32) - mean) / std
        p = z @ components.T
        p /= np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(p, dtype=np.float32)

    def fit(self, keys: np.ndarray, values: np.ndarray) -> DenseDatastore:
        """``keys`` [n, d] float, ``values`` [n, value_len] int (-1 pads short tails)."""
        import faiss

        keys = np.asarray(keys, dtype=np.float32)
        if len(keys) == 0:
            raise ValueError("empty datastore")
        self.mean = keys.mean(axis=0)
        self.std = keys.std(axis=0) + 1e-6
        z = (keys - self.mean) / self.std
        sample = z if len(z) <= 20000 else z[np.random.default_rng(0).choice(len(z), 20000, replace=False)]
        _, _, vt = np.linalg.svd(sample.astype(np.float64), full_matrices=False)
        dim = min(self.pca_dim, vt.shape[0])
        self.components = vt[:dim].astype(np.float32)
        proj = self._project(keys)
        index: faiss.Index
        if self.index_kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexFlatIP(dim)
        self.index = index
        index.add(proj)
        self.values = np.asarray(values, dtype=np.int64)
        return self

    # ---------------------------------------------------------------- search
    def search(self, hidden, k: int) -> list[np.ndarray]:
        """Values of the ``k`` nearest keys (best first), padding stripped."""
        if self.index is None:
            return []
        h = hidden.detach().float().cpu().numpy() if isinstance(hidden, torch.Tensor) else np.asarray(hidden)
        _, idx = self.index.search(self._project(h.reshape(1, -1)), int(k))
        values = self._fitted_values()
        out = []
        for i in idx[0]:
            if i < 0:
                continue
            v = values[i]
            out.append(v[v >= 0])
        return out

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> None:
        mean, std, components = self._pca()
        np.savez(
            path,
            mean=mean,
            std=std,
            components=components,
            values=self._fitted_values(),
            keys=self._keys_proj(),
            meta=np.array([self.pca_dim, self.value_len]),
        )

    def _keys_proj(self) -> np.ndarray:
        if self.index_kind != "flat":
            return np.zeros((0,))
        index = self._fitted_index()
        return index.reconstruct_n(0, index.ntotal)

    @classmethod
    def load(cls, path: str | Path) -> DenseDatastore:
        import faiss

        z = np.load(path)
        ds = cls(int(z["meta"][0]), int(z["meta"][1]))
        ds.mean, ds.std, ds.components, ds.values = z["mean"], z["std"], z["components"], z["values"]
        index = faiss.IndexFlatIP(z["components"].shape[0])
        index.add(np.ascontiguousarray(z["keys"], dtype=np.float32))
        ds.index = index
        return ds


class DenseDrafter:
    """Drafts from a :class:`DenseDatastore` for one step."""

    needs_hidden = True

    def __init__(
        self,
        store: DenseDatastore,
        num_drafts: int = C.DENSE_NUM_DRAFTS,
        draft_len: int = C.DENSE_DRAFT_LEN,
        candidates: int = C.DENSE_CANDIDATES,
    ):
        self.store, self.num_drafts, self.draft_len, self.candidates = store, num_drafts, draft_len, candidates

    def propose(self, seq, hidden, nxt: int, m: int | None = None) -> list[list[int]]:
        m = self.draft_len if m is None else min(m, self.draft_len)
        if hidden is None or m <= 0:
            return []
        drafts: list[list[int]] = []
        seen = set()
        for v in self.store.search(hidden, self.candidates):
            if len(v) < 2 or int(v[0]) != nxt:
                continue
            d = tuple(int(t) for t in v[1 : 1 + m])
            if d in seen:
                continue
            seen.add(d)
            drafts.append(list(d))
            if len(drafts) >= self.num_drafts:
                break
        return drafts


# -------------------------------------------------------------------- collection
@torch.inference_mode()
def collect_sequences(
    engine, examples: Iterable[tuple[Sequence[str], Sequence[int], int, int]], value_len: int = C.DENSE_DRAFT_LEN + 1
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-force ``[docs][tokens]`` and record (hidden at p, tokens[p+1 : p+1+value_len])
    for positions ``start-1 <= p < end-1`` of ``tokens`` (each example: doc texts, tokens,
    start, end). Returns (keys, values)."""
    keys, vals = [], []
    for doc_texts, toks, start, end in examples:
        toks = list(toks)
        docs = [engine.doc_tokens(t) for t in doc_texts if t]
        past, _ = docs_past(engine, docs)
        ids = torch.tensor([toks[:end]], dtype=torch.long, device=engine.device)
        out = engine.model(input_ids=ids, use_cache=True, output_hidden_states=True, **cache_kwargs(engine.model, past))
        hs = out.hidden_states[-1][0].float().cpu().numpy()
        for p in range(max(0, start - 1), end - 1):
            v = toks[p + 1 : p + 1 + value_len]
            keys.append(hs[p])
            vals.append(v + [-1] * (value_len - len(v)))
    if not keys:
        return np.zeros((0, engine.model.config.hidden_size), np.float32), np.zeros((0, value_len), np.int64)
    return np.stack(keys), np.asarray(vals, dtype=np.int64)


def collect_corpus(
    engine, texts: Iterable[str], max_tokens: int = C.MAX_DOC_TOKENS, value_len: int = C.DENSE_DRAFT_LEN + 1
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced hidden states over corpus passages (no document prefix)."""
    ex = []
    for t in texts:
        ids = engine.tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            ex.append(((), ids, 1, len(ids)))
    return collect_sequences(engine, ex, value_len)


def build_datastore(
    keys: np.ndarray, values: np.ndarray, pca_dim: int = C.DENSE_PCA_DIM, index: str = "flat"
) -> DenseDatastore:
    return DenseDatastore(pca_dim, values.shape[1], index).fit(keys, values)
