"""The LM side of a KNN-LM request: feed tokens, read the query ``h`` and ``p_lm``.

:class:`KnnStepper` runs the model on one Hugging Face cache; :class:`BatchedKnnStepper`
runs each feed on the engine's continuous batcher (``ralm.batching``), batched with every
other request's steps. Both give the same bits on an invariant model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ralm.batching.engine import FeedCall
from ralm.batching.paged_kv import PagedKV
from ralm.hf_cache import cache_kwargs, cache_of

if TYPE_CHECKING:
    from transformers import Cache


def lm_probs(logits: torch.Tensor) -> np.ndarray:
    """softmax of float32 logits, computed in float64 with numpy (deterministic)."""
    lg = logits.detach().to("cpu", torch.float32).numpy().astype(np.float64)
    e = np.exp(lg - lg.max())
    return e / e.sum()


class _Closing:
    """A stepper is a context manager: leaving the block :meth:`close` s it (a finished request)."""

    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KnnStepper(_Closing):
    """One prefill of the prompt, then single-token forwards on one DynamicCache.

    ``h`` is the final hidden state (float32 numpy, the query) and ``p_lm`` the float64
    LM distribution after the last token fed; ``past`` covers every token fed.
    """

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        self.past: Cache | None = None
        self.length = 0
        self.h: np.ndarray | None = None
        self.p_lm: np.ndarray | None = None
        self.forwards = 0  # model forward passes run (prefill + one per token fed)

    @torch.inference_mode()
    def _run(self, ids: list[int]) -> None:
        from transformers import DynamicCache

        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        past = self.past if self.past is not None else DynamicCache()
        out = self.model(input_ids=x, use_cache=True, output_hidden_states=True, **cache_kwargs(self.model, past))
        self.past = cache_of(out)
        self.length += len(ids)
        self.forwards += 1
        self.h = out.hidden_states[-1][0, -1].detach().to("cpu", torch.float32).numpy().copy()
        self.p_lm = lm_probs(out.logits[0, -1])

    def query(self) -> tuple[np.ndarray, np.ndarray]:
        """``(h, p_lm)`` after the last token fed."""
        if self.h is None or self.p_lm is None:
            raise RuntimeError("no token fed since the last prefill or crop")
        return self.h, self.p_lm

    def prefill(self, ids: list[int]) -> None:
        self.past, self.length = None, 0
        self._run(list(ids))

    def feed(self, token: int) -> None:
        self._run([int(token)])

    def close(self) -> None:
        """Drop the cache (a finished request)."""
        self.past, self.length = None, 0
        self.h = self.p_lm = None

    def crop(self, length: int) -> None:
        """Drop the KV of every position >= ``length`` (the tokens fed after it)."""
        if length > self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if self.past is None:
            raise RuntimeError("nothing to crop: no prefill yet")
        have = self.past.get_seq_length()
        if have != self.length:
            raise RuntimeError(f"KV cache holds {have} positions, expected {self.length}")
        remove = self.length - length
        if remove:
            # a negative argument removes that many positions, in every transformers version
            # (older ones also accept an absolute length; 5.x only a negative count)
            self.past.crop(-remove)
        if self.past.get_seq_length() != length:
            raise RuntimeError(f"KV crop to {length} left {self.past.get_seq_length()} positions")
        self.length = length
        self.h = self.p_lm = None


class BatchedKnnStepper(_Closing):
    """:class:`KnnStepper` on the engine's continuous batcher: each prefill / feed is a
    :class:`~ralm.batching.engine.FeedCall` on this request's own KV, batched with every other
    request's steps. The forward is invariant, so ``(h, p_lm)`` are the bits a lone
    :class:`KnnStepper` on the same (invariant) model would compute.

    The request's sequence lives where the batched engine keeps its sequences
    (:meth:`~ralm.batching.engine.BatchEngine.sequence_pool`: its KV pool, so the feeds join
    the pooled steps' one KV write per layer, or a pool of its own). Its blocks go back when
    the next prefill replaces it, on :meth:`close`, or when the stepper is collected."""

    def __init__(self, batcher: Any):
        self.batcher = batcher
        self.kv = self._new_kv()
        self.length = 0
        self.h: np.ndarray | None = None
        self.p_lm: np.ndarray | None = None
        self.forwards = 0

    def _run(self, ids: list[int]) -> None:
        out = self.batcher.submit(FeedCall(self.kv, [int(t) for t in ids])).result()
        self.length += len(ids)
        self.forwards += 1
        self.h = out.hidden.detach().to("cpu", torch.float32).numpy().copy()
        self.p_lm = lm_probs(out.logits)

    def query(self) -> tuple[np.ndarray, np.ndarray]:
        """``(h, p_lm)`` after the last token fed."""
        if self.h is None or self.p_lm is None:
            raise RuntimeError("no token fed since the last prefill or crop")
        return self.h, self.p_lm

    def _new_kv(self) -> PagedKV:
        return PagedKV(self.batcher.engine.sequence_pool())

    def close(self) -> None:
        """Give the sequence's blocks back (idempotent)."""
        self.kv.free()

    def __del__(self) -> None:
        kv = getattr(self, "kv", None)
        if kv is not None:
            kv.free()

    def prefill(self, ids: list[int]) -> None:
        self.kv.free()
        self.kv, self.length = self._new_kv(), 0
        self._run(list(ids))

    def feed(self, token: int) -> None:
        self._run([int(token)])

    def crop(self, length: int) -> None:
        """Drop the KV of every position >= ``length``."""
        if length > self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.kv.crop(length)
        self.length = length
        self.h = self.p_lm = None


def stepper_for(lm: Any) -> KnnStepper | BatchedKnnStepper:
    """The batched stepper when ``lm`` (an engine) has a continuous batcher (the request's KV in
    its engine's pool), else the plain one."""
    batcher = getattr(lm, "batcher", None)
    if batcher is not None:
        return BatchedKnnStepper(batcher)
    return KnnStepper(getattr(lm, "model", lm))
