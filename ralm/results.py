"""What a request returns: its text and tokens with the statistics that explain its latency."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    method: str = "seq"                  # "seq" (RaLMSeq) or "spec[P,S,A]" (RaLMSpec)
    retriever: str = ""
    steps: int = 0                       # committed steps (one document each)
    kb_calls: int = 0                    # calls to the knowledge base (a batch counts once)
    kb_queries: int = 0                  # queries sent to the knowledge base
    spec_steps: int = 0                  # speculative steps run (including discarded ones)
    cache_lookups: int = 0
    verifications: int = 0
    matched_steps: int = 0               # speculative steps confirmed by verification
    rollbacks: int = 0
    regenerated_tokens: int = 0          # tokens thrown away by rollbacks
    async_steps_kept: int = 0            # async steps that became the next window's first step
    async_steps_discarded: int = 0
    direct_steps: int = 0                # OS3 chose s = 0: plain KB retrieval for the step
    strides: list[int] = field(default_factory=list)   # window size of each verification
    gamma: float | None = None           # final OS3 estimate of speculation accuracy
    gen_time_s: float = 0.0              # G: wall time inside the generator
    retrieval_time_s: float = 0.0        # R: everything else (KB waits, caches, encoding)
    total_time_s: float = 0.0
    doc_kv_hits: int = 0
    doc_ids: list[int] = field(default_factory=list)   # document used at each committed step

    @property
    def speculation_accuracy(self) -> float | None:
        """Fraction of verified speculative steps whose document was right."""
        checked = self.matched_steps + self.rollbacks
        return self.matched_steps / checked if checked else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["speculation_accuracy"] = self.speculation_accuracy
        return d


@dataclass
class RalmResult:
    text: str
    tokens: list[int]                    # generated tokens (EOS excluded)
    stats: RequestStats
    finish_reason: str = "length"        # "stop" (EOS) or "length"

    def as_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "stats": self.stats.as_dict()}
