"""Generation-side acceleration of the step ``f`` (docs/design.md, "Generation-side acceleration").

- :mod:`ralm.drafting.ngram`  -- IGPG n-gram drafts from the documents and the question;
- :mod:`ralm.drafting.dense`  -- DReSD drafts from a datastore of hidden states;
- :mod:`ralm.drafting.decode` -- the drafted greedy decode loop (one forward per draft round);
- :mod:`ralm.drafting.idgr`   -- the opt-in IDGR instruction block (changes outputs);
- :mod:`ralm.drafting.exactness` -- first divergence between two decodings and its top-2 logit gap.

(Multi-document KV assembly over the doc-KV prefix tree is :mod:`ralm.doc_kv`.)

Drafting changes how ``f`` computes, not what it means: accepted tokens are exactly the
greedy argmax of the verifying forward pass. In float32 a multi-token forward can differ
from one-token-at-a-time in the last bits, so outputs can differ only at near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

from ralm import constants as C


@dataclass(frozen=True)
class StepOptions:
    """Per-step options of :meth:`ralm.engine.LMEngine.step` (built from a RequestConfig)."""

    drafting: str = "none"  # none | ngram | dense
    ngram_n: int = C.NGRAM_N
    ngram_min_n: int = C.NGRAM_MIN_N
    ngram_m: int = C.NGRAM_M
    dense_num_drafts: int = C.DENSE_NUM_DRAFTS
    dense_draft_len: int = C.DENSE_DRAFT_LEN
    dense_candidates: int = C.DENSE_CANDIDATES
    flare_threshold: float | None = None  # FLARE: end the step before a token with p < threshold
    num_docs: int = 1  # documents placed in the prompt (the rest of a doc tuple: IDGR 'unrelated')
    idgr: bool = False  # prepend the IDGR instruction block (changes outputs)
    allow_inexact_shifted_reuse: bool = False  # IDR2 position-shifted doc-KV reuse (changes outputs)

    @property
    def plain(self) -> bool:
        return self.drafting == "none" and self.flare_threshold is None

    @classmethod
    def from_request(cls, req) -> StepOptions:
        return cls(
            drafting=req.drafting,
            ngram_n=req.ngram_n,
            ngram_min_n=req.ngram_min_n,
            ngram_m=req.ngram_m,
            dense_num_drafts=req.dense_num_drafts,
            dense_draft_len=req.dense_draft_len,
            dense_candidates=req.dense_candidates,
            flare_threshold=req.flare_threshold if req.workload == "flare" else None,
            num_docs=req.num_docs,
            idgr=req.idgr,
            allow_inexact_shifted_reuse=req.allow_inexact_shifted_reuse,
        )


DEFAULT_OPTIONS = StepOptions()


def greedy_scores(logits, eos_token_id: int | None, ignore_eos: bool):
    """The scores every decoder takes the greedy token from: ``logits`` (``[..., vocab]``) as
    float32, with EOS masked to -inf under ``ignore_eos``. ``torch.argmax`` of them gives the
    lowest id on ties. One rule for the plain, drafted and batched decoders."""
    s = logits.float()
    if ignore_eos and eos_token_id is not None:
        s = s.clone()
        s[..., eos_token_id] = float("-inf")
    return s


def greedy_tokens(logits, eos_token_id: int | None, ignore_eos_rows: list[int]) -> list[int]:
    """The greedy token of every row of ``logits [R, vocab]``, brought to the host in one
    transfer: each row's argmax of :func:`greedy_scores` (EOS masked in ``ignore_eos_rows``).
    A row's argmax is the one it gets alone: max is exact and ties go to the lowest id.
    Example: rows ``[a, b0, b1]`` (one step's decode row, another's drafted pair) give
    ``[t_a, t_b0, t_b1]`` with one synchronisation, not three."""
    import torch

    s = logits.float()
    if eos_token_id is not None and ignore_eos_rows:
        s = s.clone()
        s[torch.tensor(ignore_eos_rows, device=s.device), eos_token_id] = float("-inf")
    return s.argmax(dim=-1).tolist()
