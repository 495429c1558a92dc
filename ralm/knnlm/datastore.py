"""The KNN-LM datastore: one entry per corpus token, stored in corpus order.

Entry ``i`` of passage ``p`` (tokens ``t_0 .. t_{L-1}``, truncated to
``max_passage_tokens``): key = the LM's final hidden state (float32) after reading
``t_0 .. t_j`` (the left context within the passage), value = ``t_{j+1}``. A passage of
``L`` tokens gives ``L - 1`` entries; entries of a passage are consecutive and in order,
so entry ``i + 1`` is what followed entry ``i`` (the spatial locality the speculative
cache uses). ``passage[i]`` is entry ``i``'s passage row.

On disk (a directory): ``keys.npy`` (N, d) float32, ``values.npy`` (N,) int32,
``passage.npy`` (N,) int32, optional ``hnsw.faiss``, and ``manifest.json`` with the
model fingerprint, the corpus sha256 and the counts. Loading checks them all and says
which one does not match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ralm import constants as C
from ralm.errors import RalmInputError
from ralm.retrieval.dense import padding_vectors

log = logging.getLogger(__name__)

FORMAT = "ralmspec-knn-datastore/1"
PAD_SEED = 20240918


class DatastoreError(RalmInputError):
    """A datastore is missing, corrupt, or was built for another model or corpus."""


def _model_and_tokenizer(lm: Any, tokenizer: Any = None):
    model = getattr(lm, "model", lm)
    tok = tokenizer if tokenizer is not None else getattr(lm, "tokenizer", None)
    if tok is None:
        raise ValueError("a tokenizer is needed: pass an LMEngine or (model, tokenizer)")
    return model, tok


def model_fingerprint(lm: Any, tokenizer: Any = None) -> str:
    """sha256 over the model config, every parameter's name, shape, dtype and bytes, and the
    tokenizer's vocabulary: two models share a fingerprint only if they compute the same keys."""
    import torch

    model, tok = _model_and_tokenizer(lm, tokenizer)
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for drop in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(drop, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            t = p.detach().to("cpu").contiguous()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
            h.update(
                t.view(torch.uint8).numpy().tobytes()
                if t.dtype != torch.bfloat16
                else t.view(torch.int16).numpy().tobytes()
            )
    vocab = sorted(tok.get_vocab().items())
    h.update(json.dumps(vocab).encode())
    return h.hexdigest()


@dataclass
class Datastore:
    keys: np.ndarray  # (N, d) float32, read-only
    values: np.ndarray  # (N,) int32: the next token
    passage: np.ndarray  # (N,) int32: passage row of each entry
    manifest: dict
    hnsw: Any = None  # FAISS IndexHNSWFlat over keys (L2), if built/loaded

    def __post_init__(self) -> None:
        self.keys = np.ascontiguousarray(self.keys, dtype=np.float32)
        self.values = np.asarray(self.values, dtype=np.int32)
        self.passage = np.asarray(self.passage, dtype=np.int32)
        if self.keys.ndim != 2 or len(self.keys) != len(self.values) or len(self.values) != len(self.passage):
            raise DatastoreError(
                f"datastore arrays disagree: keys {self.keys.shape}, values "
                f"{self.values.shape}, passage {self.passage.shape}"
            )
        self.keys.setflags(write=False)
        self.max_norm = 0.0
        for s in range(0, len(self.keys), 1 << 16):
            blk = self.keys[s : s + (1 << 16)].astype(np.float64)
            self.max_norm = max(self.max_norm, float(np.sqrt(np.einsum("ij,ij->i", blk, blk).max())))

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def dim(self) -> int:
        return int(self.keys.shape[1])

    def __repr__(self) -> str:
        return f"Datastore(entries={len(self)}, dim={self.dim}, passages={self.manifest.get('n_passages')})"

    # ------------------------------------------------------------------ indexes
    def build_hnsw(self, m: int = C.HNSW_M, ef_construction: int = C.HNSW_EF_CONSTRUCTION, progress: bool = False):
        """Build (and keep) the approximate index: FAISS IndexHNSWFlat, L2."""
        import faiss

        index = faiss.IndexHNSWFlat(self.dim, int(m))
        index.hnsw.efConstruction = int(ef_construction)
        step = 10000
        it = range(0, len(self), step)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=(len(self) + step - 1) // step, desc="building KNN HNSW", unit="chunk")
        for s in it:
            index.add(self.keys[s : s + step])
        self.hnsw = index
        self.manifest["hnsw"] = {"m": int(m), "ef_construction": int(ef_construction)}
        return index

    def flat_index(self, pad_to: int = 0):
        """The exact index: FAISS IndexFlatL2 over the keys, padded with far-away random
        vectors up to ``pad_to`` rows (ids >= len(self); never in a top-k)."""
        import faiss

        index = faiss.IndexFlatL2(self.dim)
        index.add(self.keys)
        for x in self.pad_chunks(max(0, int(pad_to) - len(self)) if pad_to else 0):
            index.add(x)
        return index

    def pad_chunks(self, n_rows: int, chunk: int = 1 << 16):
        """The padding rows, ``n_rows`` in chunks of at most ``chunk`` (float32 (m, d)):
        random directions of norm ``KNN_PAD_NORM_FACTOR`` x the largest key norm
        (:func:`ralm.retrieval.dense.padding_vectors` with this datastore's seed and norm)."""
        norm = C.KNN_PAD_NORM_FACTOR * max(self.max_norm, 1.0)
        return padding_vectors(int(n_rows), self.dim, seed=PAD_SEED, norm=norm, chunk=chunk)

    # ------------------------------------------------------------------ save / load
    def save(self, directory: str | Path) -> Path:
        import faiss

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "keys.npy", self.keys)
        np.save(d / "values.npy", self.values)
        np.save(d / "passage.npy", self.passage)
        if self.hnsw is not None:
            faiss.write_index(self.hnsw, str(d / "hnsw.faiss"))
        man = dict(self.manifest)
        man.update(format=FORMAT, n_entries=len(self), dim=self.dim, has_hnsw=self.hnsw is not None)
        (d / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))
        self.manifest = man
        return d

    @classmethod
    def load(
        cls,
        directory: str | Path,
        lm: Any = None,
        corpus: Any = None,
        *,
        tokenizer: Any = None,
        fingerprint: str | None = None,
        mmap: bool = True,
    ) -> Datastore:
        """Load a saved datastore; with ``lm``/``fingerprint`` and ``corpus`` given, check
        they are the ones it was built with (:class:`DatastoreError` otherwise)."""
        import faiss

        d = Path(directory)
        mpath = d / "manifest.json"
        if not mpath.is_file():
            raise DatastoreError(f"no KNN-LM datastore at {d} (manifest.json missing); build one first")
        try:
            man = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise DatastoreError(f"{mpath}: not valid JSON ({e.msg})") from None
        if man.get("format") != FORMAT:
            raise DatastoreError(f"{mpath}: format {man.get('format')!r}, expected {FORMAT!r}")
        if lm is not None and fingerprint is None:
            fingerprint = model_fingerprint(lm, tokenizer)
        if fingerprint is not None and fingerprint != man.get("model_fingerprint"):
            raise DatastoreError(
                f"datastore at {d} was built with another model (fingerprint "
                f"{str(man.get('model_fingerprint'))[:12]}..., this model {fingerprint[:12]}...; "
                f"model {man.get('model')!r}); rebuild it"
            )
        if corpus is not None:
            if corpus.sha256 != man.get("corpus_sha256"):
                raise DatastoreError(
                    f"datastore at {d} was built from another corpus (sha256 "
                    f"{str(man.get('corpus_sha256'))[:12]}..., this corpus {corpus.sha256[:12]}...); rebuild it"
                )
            if int(man.get("n_passages", -1)) > len(corpus):
                raise DatastoreError(
                    f"datastore at {d} covers {man.get('n_passages')} passages; the corpus has only {len(corpus)}"
                )
        mode: Literal["r"] | None = "r" if mmap else None
        try:
            keys = np.load(d / "keys.npy", mmap_mode=mode)
            values = np.load(d / "values.npy")
            passage = np.load(d / "passage.npy")
        except (OSError, ValueError) as e:
            raise DatastoreError(f"datastore at {d} is incomplete or corrupt: {e}") from None
        n = int(man.get("n_entries", -1))
        if not (len(keys) == len(values) == len(passage) == n) or keys.ndim != 2 or keys.shape[1] != man.get("dim"):
            raise DatastoreError(
                f"datastore at {d}: counts disagree with the manifest "
                f"(manifest {n} x {man.get('dim')}, files keys {tuple(keys.shape)}, "
                f"values {len(values)}, passage {len(passage)})"
            )
        hnsw = None
        if man.get("has_hnsw"):
            hp = d / "hnsw.faiss"
            if not hp.is_file():
                raise DatastoreError(f"datastore at {d}: manifest lists an HNSW index but hnsw.faiss is missing")
            hnsw = faiss.read_index(str(hp))
            if hnsw.ntotal != n or hnsw.d != keys.shape[1]:
                raise DatastoreError(
                    f"datastore at {d}: hnsw.faiss has {hnsw.ntotal} x {hnsw.d}, expected {n} x {keys.shape[1]}"
                )
        return cls(np.asarray(keys), values, passage, man, hnsw)


def build_datastore(
    lm: Any,
    corpus: Any,
    *,
    tokenizer: Any = None,
    n_passages: int | None = None,
    max_passage_tokens: int = C.KNN_MAX_PASSAGE_TOKENS,
    hnsw: bool = False,
    hnsw_m: int = C.HNSW_M,
    hnsw_ef_construction: int = C.HNSW_EF_CONSTRUCTION,
    progress: bool = True,
) -> Datastore:
    """Build the datastore of ``corpus`` (its first ``n_passages`` rows) with the generator
    ``lm`` (an :class:`~ralm.engine.LMEngine`, or a HF model with ``tokenizer``)."""
    import torch

    model, tok = _model_and_tokenizer(lm, tokenizer)
    model.eval()
    device = next(model.parameters()).device
    n = len(corpus) if n_passages is None else min(int(n_passages), len(corpus))
    max_pos = 1 << 30
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(model.config, name, None)
        if isinstance(v, int) and v > 0:
            max_pos = v
            break
    limit = min(int(max_passage_tokens), max_pos)
    keys, values, passage = [], [], []
    t0 = time.perf_counter()
    it = range(n)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="building KNN datastore", unit="passage")
    with torch.inference_mode():
        for row in it:
            ids = tok(corpus.text(row), add_special_tokens=False)["input_ids"][:limit]
            if len(ids) < 2:
                continue
            x = torch.tensor([ids], dtype=torch.long, device=device)
            out = model(input_ids=x, use_cache=False, output_hidden_states=True)
            h = out.hidden_states[-1][0, :-1].float().cpu().numpy()
            keys.append(h)
            values.append(np.asarray(ids[1:], dtype=np.int32))
            passage.append(np.full(len(ids) - 1, row, dtype=np.int32))
    if not keys:
        raise DatastoreError("the corpus produced no datastore entries (every passage has < 2 tokens)")
    manifest = {
        "format": FORMAT,
        "model": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
        "model_fingerprint": model_fingerprint(model, tok),
        "corpus_sha256": corpus.sha256,
        "corpus_path": getattr(corpus, "path", ""),
        "n_passages": n,
        "max_passage_tokens": limit,
        "vocab_size": int(len(tok)),
        "build_s": round(time.perf_counter() - t0, 3),
    }
    ds = Datastore(np.concatenate(keys), np.concatenate(values), np.concatenate(passage), manifest)
    ds.manifest.update(n_entries=len(ds), dim=ds.dim)
    if hnsw:
        ds.build_hnsw(hnsw_m, hnsw_ef_construction, progress=progress)
    log.info("built %r in %.1fs", ds, time.perf_counter() - t0)
    return ds
