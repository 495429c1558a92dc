"""What one generator step returns (the engine's and the batched engine's result type)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutput:
    tokens: list[int]  # generated token ids, EOS excluded
    eos: bool  # the step ended on EOS
    prefill_s: float  # doc-KV (on a miss) + context prefill wall time
    decode_s: float  # incremental decode wall time
    doc_kv_hit: bool
    # additive statistics (drafting, multi-document KV reuse, FLARE)
    forward_passes: int = 0  # model forward passes, prefill included (doc KV excluded)
    draft_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    docs_reused: int = 0  # documents whose KV came from the doc-KV cache
    docs_computed: int = 0
    kv_bytes_reused: int = 0
    low_confidence: bool = False  # FLARE: the step ended before a low-probability token
    context_reused: int = 0  # context tokens whose KV came from the request's KV session
    context_computed: int = 0  # context tokens fed to the model before the first new token
