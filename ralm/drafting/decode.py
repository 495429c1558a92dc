"""The step's greedy decode loop with drafting (n-gram / dense) and the FLARE stop.

After the context prefill, every round takes the model's next token ``nxt`` (argmax, ties
to the lowest id, EOS masked with ``ignore_eos``), asks the drafter for continuations of
``context + generated + nxt`` and runs ONE forward pass over ``[nxt, draft...]`` (several
drafts: one batched pass, the KV repeated per draft). A draft token is accepted while it
equals the argmax at its position; the argmax after the last accepted token is the bonus
token (the next round's ``nxt``). The KV of the best draft is kept and cropped to the
accepted length. Never more than ``k`` tokens: drafts are cut to ``k - emitted - 1``.
With ``flare_threshold`` the step ends before the first token (after the first) whose
greedy probability is below the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ralm.drafting import greedy_scores
from ralm.hf_cache import cache_kwargs, cache_of


@dataclass
class DecodeResult:
    tokens: list[int]
    eos: bool
    forward_passes: int = 0  # including the context prefill
    draft_rounds: int = 0  # verification forwards that carried a draft
    drafted_tokens: int = 0  # tokens of the selected draft, summed over rounds
    accepted_tokens: int = 0  # draft tokens accepted
    low_confidence: bool = False  # FLARE: ended before a low-probability token
    prefill_end: float = 0.0  # perf_counter() after the prefill


def _prob(scores: torch.Tensor, tok: int) -> float:
    return float(torch.softmax(scores, dim=-1)[tok])


@torch.inference_mode()
def drafted_decode(engine, past, context, k: int, ignore_eos: bool, opts, drafter=None) -> DecodeResult:
    import time

    model, dev = engine.model, engine.device
    need_hidden = drafter is not None and getattr(drafter, "needs_hidden", False)
    eos_id = engine.eos_token_id
    mask = ignore_eos and eos_id is not None
    thr = opts.flare_threshold

    def scores(x: torch.Tensor) -> torch.Tensor:
        return greedy_scores(x, eos_id, mask)

    ids = torch.tensor([list(context)], dtype=torch.long, device=dev)
    out = model(input_ids=ids, use_cache=True, output_hidden_states=need_hidden, **cache_kwargs(model, past))
    res = DecodeResult([], False, forward_passes=1, prefill_end=time.perf_counter())
    logits, past = out.logits[0, -1], cache_of(out)
    hidden = out.hidden_states[-1][0, -1] if need_hidden else None
    history = list(context)
    tokens = res.tokens
    while True:
        s = scores(logits)
        nxt = int(torch.argmax(s))
        if eos_id is not None and nxt == eos_id:
            res.eos = True
            break
        if thr is not None and tokens and _prob(s, nxt) < thr:
            res.low_confidence = True
            break
        tokens.append(nxt)
        if len(tokens) >= k:
            break
        m = k - len(tokens) - 1
        drafts = drafter.propose(history + tokens, hidden, nxt, m) if (drafter is not None and m > 0) else []
        drafts = [list(d[:m]) for d in drafts if len(d)]
        if not drafts:
            out = model(
                input_ids=torch.tensor([[nxt]], dtype=torch.long, device=dev),
                use_cache=True,
                output_hidden_states=need_hidden,
                **cache_kwargs(model, past),
            )
            res.forward_passes += 1
            logits, past = out.logits[0, -1], cache_of(out)
            hidden = out.hidden_states[-1][0, -1] if need_hidden else None
            continue
        B, L = len(drafts), max(len(d) for d in drafts)
        rows = [[nxt] + d + [d[-1]] * (L - len(d)) for d in drafts]
        base = past.get_seq_length()
        if B > 1:
            past.batch_repeat_interleave(B)
        out = model(
            input_ids=torch.tensor(rows, dtype=torch.long, device=dev),
            use_cache=True,
            output_hidden_states=need_hidden,
            **cache_kwargs(model, past),
        )
        res.forward_passes += 1
        res.draft_rounds += 1
        sc = scores(out.logits)  # [B, L+1, V]
        preds = torch.argmax(sc, dim=-1).tolist()
        best, best_a = 0, -1
        for b, d in enumerate(drafts):
            a = 0
            while a < len(d) and d[a] == preds[b][a] and d[a] != eos_id:
                if thr is not None and _prob(sc[b, a], d[a]) < thr:
                    break
                a += 1
            if a > best_a:
                best, best_a = b, a
        past = cache_of(out)
        if B > 1:
            past.batch_select_indices(torch.tensor([best], device=dev))
        drop = past.get_seq_length() - (base + 1 + best_a)
        if drop > 0:
            past.crop(-drop)  # negative: remove that many trailing positions
        tokens.extend(drafts[best][:best_a])
        res.drafted_tokens += len(drafts[best])
        res.accepted_tokens += best_a
        logits = out.logits[best, best_a]
        hidden = out.hidden_states[-1][best, best_a] if need_hidden else None
    return res
