"""KV of a document sequence ``[d1]..[dn]``, reused through the doc-KV prefix tree.

Canonical computation (what ``f`` means for n documents): ``d1`` alone, then ``d2`` on top
of ``d1``'s KV, and so on, one forward pass per document. A cached prefix returns the very
tensors that computation produced (concatenated segments), and the remaining documents
are computed on top of it with the same inputs, so the result is bit-identical with and
without the cache. For n = 1 this is the original "document alone" KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class DocsKVInfo:
    hit: bool = False            # every document came from the cache
    docs_reused: int = 0
    docs_computed: int = 0
    bytes_reused: int = 0
    shifted: int = 0             # inexact position-shifted reuses


def segment_bytes(seg) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in seg)


def segment_of(cache, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) of positions ``start:`` (copies)."""
    return [(layer.keys[..., start:, :].clone(), layer.values[..., start:, :].clone()) for layer in cache.layers]


def cache_from_segments(segs: Sequence[list]) -> Any:
    """A fresh DynamicCache holding the concatenation of ``segs`` (a private copy)."""
    from transformers import DynamicCache

    if not segs:
        return None
    cache = DynamicCache()
    for li in range(len(segs[0])):
        k = torch.cat([s[li][0] for s in segs], dim=-2)
        v = torch.cat([s[li][1] for s in segs], dim=-2)
        cache.update(k, v, li)
    return cache


@torch.inference_mode()
def docs_past(engine, docs: Sequence[tuple], allow_shifted: bool = False) -> tuple[Any, DocsKVInfo]:
    """(private KV of the document sequence, info). ``docs`` are token tuples (non-empty)."""
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
    for j in range(len(segs), len(docs)):
        if allow_shifted and j > 0 and use_cache:
            seg = tree.standalone(docs[j])
            if seg is not None:                       # INEXACT: KV computed at other positions
                segs.append(seg)
                past = cache_from_segments(segs)
                info.shifted += 1
                info.bytes_reused += segment_bytes(seg)
                exact = False
                continue
        start = past.get_seq_length() if past is not None else 0
        ids = torch.tensor([docs[j]], dtype=torch.long, device=dev)
        past = model(input_ids=ids, past_key_values=past, use_cache=True).past_key_values
        info.docs_computed += 1
        if use_cache and exact:
            seg = segment_of(past, start)
            tree.insert(docs[: j + 1], seg)
            segs.append(seg)
    info.hit = info.docs_computed == 0 and info.shifted == 0
    return past, info
