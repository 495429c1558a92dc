"""Where do two decodings part, and was it a floating-point near-tie?

Drafted decoding verifies several tokens per forward pass; in float32 that rounds
differently from one-token-at-a-time, so the greedy choice can flip only where the top-2
logits are (nearly) tied. :func:`first_divergence` finds the first differing position and
reports the plain decoding's top-2 logit gap there (recomputed by a prefill over
``[docs][context + common prefix]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ralm import constants as C
from ralm.doc_kv import docs_past
from ralm.hf_cache import cache_kwargs


@dataclass
class Divergence:
    position: int  # index into the generated tokens
    plain_token: int | None  # None: the plain decoding ended here
    other_token: int | None
    top2_gap: float  # plain decoding's top-1 minus top-2 logit at that position

    def near_tie(self, threshold: float = C.DIVERGENCE_GAP) -> bool:
        return self.top2_gap < threshold

    def as_dict(self) -> dict:
        return asdict(self)


def first_index(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(engine, doc_texts, tokens: Sequence[int], ignore_eos: bool = False) -> float:
    """Top-1 minus top-2 logit of the next token after ``[docs][tokens]``."""
    if isinstance(doc_texts, str):
        doc_texts = [doc_texts]
    docs = [engine.doc_tokens(t) for t in (doc_texts or []) if t]
    past, _ = docs_past(engine, docs)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=engine.device)
    logits = engine.model(input_ids=ids, use_cache=True, **cache_kwargs(engine.model, past)).logits[0, -1].float()
    if ignore_eos and engine.eos_token_id is not None:
        logits[engine.eos_token_id] = float("-inf")
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def first_divergence(
    engine, doc_texts, context: Sequence[int], plain: Sequence[int], other: Sequence[int], ignore_eos: bool = False
) -> Divergence | None:
    """None if ``plain == other``; else the first divergence with its top-2 gap (one step,
    or a request whose document at the divergence is ``doc_texts``)."""
    i = first_index(plain, other)
    if i is None:
        return None
    gap = top2_gap(engine, doc_texts, list(context) + list(plain[:i]), ignore_eos)
    return Divergence(i, plain[i] if i < len(plain) else None, other[i] if i < len(other) else None, gap)
