"""KV of a document sequence ``[d1]..[dn]``, reused through the doc-KV prefix tree.

Canonical computation (what ``f`` means for n documents): ``d1`` alone, then ``d2`` on top
of ``d1``'s KV, and so on, one forward pass per document. A cached prefix returns the very
tensors that computation produced (concatenated segments), and the remaining documents
are computed on top of it with the same inputs, so the result is bit-identical with and
without the cache. For n = 1 this is the original "document alone" KV.

No copies on a hit: the cache handed to the model holds the stored segment tensors
themselves and concatenates them once, together with the first new keys/values, inside
the model's first cache update (:class:`SegmentsLayer`). Hugging Face's dynamic cache
only ever *replaces* its tensors (``torch.cat``, slicing), it never writes into them, so
the stored segments are never modified; ``tests/cache/test_doc_kv.py`` checks this.
Document forward passes ask for no logits (``logits_to_keep=1``): the KV does not depend
on the LM head.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ralm.hf_cache import cache_kwargs, cache_of


@dataclass
class DocsKVInfo:
    hit: bool = False  # every document came from the cache
    docs_reused: int = 0
    docs_computed: int = 0
    bytes_reused: int = 0
    shifted: int = 0  # inexact position-shifted reuses


def segment_bytes(seg) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in seg)


def segment_of(cache, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) of positions ``start:``. ``start == 0``: the cache's own tensors
    (no copy; the cache replaces them on its next update, it never writes into them);
    otherwise a copy, so that a stored segment does not keep its whole prefix alive."""
    if start == 0:
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(layer.keys[..., start:, :].clone(), layer.values[..., start:, :].clone()) for layer in cache.layers]


def _segments_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SegmentsLayer(DynamicLayer):
        """A dynamic cache layer made of read-only segments, concatenated lazily: once,
        together with the new keys/values of the first ``update`` (or on the first read of
        ``keys``/``values``). Afterwards it is a plain :class:`DynamicLayer`."""

        def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
            self._pending: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
            super().__init__()
            self._pending = (list(keys), list(values))
            self._pending_len = sum(int(k.shape[-2]) for k in keys)
            self.dtype, self.device = keys[0].dtype, keys[0].device
            self.is_initialized = True

        def _materialize(self, k_new=None, v_new=None) -> None:
            if self._pending is None:  # the callers check first
                raise RuntimeError("the segments are already concatenated")
            ks, vs = self._pending
            self._pending = None
            if k_new is not None:
                ks, vs = ks + [k_new], vs + [v_new]
            # a single stored segment and nothing new: the tensor itself (replaced, never written, later)
            self._keys = ks[0] if len(ks) == 1 else torch.cat(ks, dim=-2)
            self._values = vs[0] if len(vs) == 1 else torch.cat(vs, dim=-2)

        @property
        def keys(self):
            if self._pending is not None:
                self._materialize()
            return self._keys

        @keys.setter
        def keys(self, t):
            self._keys = t

        @property
        def values(self):
            if self._pending is not None:
                self._materialize()
            return self._values

        @values.setter
        def values(self, t):
            self._values = t

        def update(self, key_states, value_states, *args, **kwargs):
            if self._pending is not None:
                self._materialize(key_states, value_states)
                return self._keys, self._values
            return super().update(key_states, value_states, *args, **kwargs)

        def get_seq_length(self) -> int:
            if self._pending is not None:
                return self._pending_len
            return super().get_seq_length()

    return SegmentsLayer


_SEGMENTS_LAYER = None


def cache_from_segments(segs: Sequence[list]) -> Any:
    """A DynamicCache whose content is the concatenation of ``segs``. It shares the segment
    tensors (no copy) and never writes into them: the first update of each layer builds a
    new tensor (one concatenation of the segments and the new keys/values)."""
    global _SEGMENTS_LAYER
    from transformers import DynamicCache

    if not segs:
        return None
    if _SEGMENTS_LAYER is None:
        _SEGMENTS_LAYER = _segments_layer_class()
    cache = DynamicCache()
    for li in range(len(segs[0])):
        cache.layers.append(_SEGMENTS_LAYER([s[li][0] for s in segs], [s[li][1] for s in segs]))
    return cache


_LAST_LOGITS: dict[type, dict] = {}


def last_logits_kwargs(model) -> dict:
    """Forward kwargs computing the logits of the last position only (``logits_to_keep=1``, as
    Hugging Face's ``generate`` does in its prefill), when the model's class supports them."""
    cls = type(model)
    kw = _LAST_LOGITS.get(cls)
    if kw is None:
        try:
            ok = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            ok = False
        kw = _LAST_LOGITS[cls] = {"logits_to_keep": 1} if ok else {}
    return kw


@torch.inference_mode()
def docs_past(engine, docs: Sequence[tuple], allow_shifted: bool = False) -> tuple[Any, DocsKVInfo]:
    """(KV of the document sequence, info). ``docs`` are token tuples (non-empty). The
    returned cache may share tensors with the doc-KV cache; like any Hugging Face dynamic
    cache it replaces them on update and never writes into them."""
    docs = tuple(tuple(d) for d in docs if d)
    info = DocsKVInfo()
    if not docs:
        return None, info
    model, dev = engine.model, engine.device
    tree = engine.doc_kv
    use_cache = engine.cfg.doc_kv_cache_bytes > 0
    segs = tree.lookup(docs) if use_cache else []
    info.docs_reused = len(segs)
    info.bytes_reused = sum(segment_bytes(s) for s in segs)
    past = cache_from_segments(segs)
    exact = True
    kw = last_logits_kwargs(model)
    for j in range(len(segs), len(docs)):
        if allow_shifted and j > 0 and use_cache:
            seg = tree.standalone(docs[j])
            if seg is not None:  # INEXACT: KV computed at other positions
                segs.append(seg)
                past = cache_from_segments(segs)
                info.shifted += 1
                info.bytes_reused += segment_bytes(seg)
                exact = False
                continue
        start = past.get_seq_length() if past is not None else 0
        ids = torch.tensor([docs[j]], dtype=torch.long, device=dev)
        past = cache_of(model(input_ids=ids, use_cache=True, **cache_kwargs(model, past), **kw))
        info.docs_computed += 1
        if use_cache and exact:
            seg = segment_of(past, start)
            tree.insert(docs[: j + 1], seg)
            segs.append(seg)
    info.hit = info.docs_computed == 0 and info.shifted == 0
    return past, info
