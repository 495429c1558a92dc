"""Deterministic LM engine: the step ``f(doc, context_tokens, k) -> tokens`` of DESIGN.md.

Prompt layout: ``[doc <= max_doc_tokens][question + generated so far]``. A step

1. takes the document's KV, computed from the document tokens alone and reused by
   token ids from a byte-bounded LRU (exact: the document is the prefix);
2. prefills the whole context (question + generated) on top of it in one forward pass;
3. decodes up to ``k`` tokens greedily (argmax; ties go to the lowest token id, which is
   what ``torch.argmax`` returns), stopping at EOS (EOS itself is not returned).

The result depends only on ``(doc tokens, context tokens, k)``: the same bits whether the
doc KV came from the cache or was just computed, and whatever ran before.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from cache.doc_kv import DocKVCache
from ralm.config import GeneratorConfig
from ralm.errors import RalmInputError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepOutput:
    tokens: list[int]          # generated token ids, EOS excluded
    eos: bool                  # the step ended on EOS
    prefill_s: float           # doc-KV (on a miss) + context prefill wall time
    decode_s: float            # incremental decode wall time
    doc_kv_hit: bool


def _kv_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class LMEngine:
    """Wraps any Hugging Face causal LM for deterministic RaLM steps."""

    def __init__(self, model, tokenizer, cfg: GeneratorConfig | None = None):
        self.cfg = cfg or GeneratorConfig()
        torch.set_num_threads(self.cfg.torch_threads)
        self.model = model.eval()
        self.tokenizer = tokenizer
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        self.eos_token_id: int | None = eos
        self.device = next(model.parameters()).device
        self.max_positions = self._max_positions(model.config)
        self.doc_kv = DocKVCache(self.cfg.doc_kv_cache_bytes, _kv_bytes)
        self._doc_tok_memo: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_config(cls, cfg: GeneratorConfig) -> "LMEngine":
        """Load ``cfg.model`` (local path or Hugging Face name) with its tokenizer."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict = {"dtype": _DTYPES[cfg.dtype]}
        if cfg.device == "auto":
            kwargs["device_map"] = "auto"     # spread layers over the visible GPUs
        try:
            tok = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
        except OSError as e:
            raise RalmInputError(f"cannot load generator {cfg.model!r}: {e}") from None
        if cfg.device != "auto":
            model = model.to(cfg.device)
        return cls(model, tok, cfg)

    @staticmethod
    def _max_positions(config) -> int:
        for name in ("n_positions", "max_position_embeddings", "n_ctx"):
            v = getattr(config, name, None)
            if isinstance(v, int) and v > 0:
                return v
        return 1 << 30

    # ------------------------------------------------------------------ text
    def encode_question(self, question: str) -> list[int]:
        """Token ids of a question; rejects empty, non-string and over-long input."""
        if not isinstance(question, str):
            raise RalmInputError(f"question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise RalmInputError("question is empty")
        ids = self.tokenizer(question, add_special_tokens=False)["input_ids"]
        if len(ids) > self.cfg.max_prompt_tokens:
            raise RalmInputError(
                f"question is {len(ids)} tokens long; the limit is {self.cfg.max_prompt_tokens} tokens"
            )
        if not ids:
            raise RalmInputError("question has no tokens")
        return list(ids)

    def doc_tokens(self, doc_text: str) -> tuple[int, ...]:
        """Document token ids truncated to ``max_doc_tokens`` (memoised by text)."""
        toks = self._doc_tok_memo.get(doc_text)
        if toks is None:
            ids = self.tokenizer(doc_text, add_special_tokens=False)["input_ids"]
            toks = tuple(ids[: self.cfg.max_doc_tokens])
            if len(self._doc_tok_memo) > 50_000:
                self._doc_tok_memo.clear()
            self._doc_tok_memo[doc_text] = toks
        return toks

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def _compute_doc_kv(self, doc: tuple[int, ...]):
        ids = torch.tensor([doc], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=True).past_key_values

    def doc_past(self, doc: tuple[int, ...]):
        """A private copy of the document's KV (cache hit or fresh), and whether it hit."""
        if not doc:
            return None, False
        if self.cfg.doc_kv_cache_bytes > 0:
            kv, hit = self.doc_kv.get_or_compute(doc, lambda: self._compute_doc_kv(doc))
        else:
            kv, hit = self._compute_doc_kv(doc), False
        return copy.deepcopy(kv), hit

    @torch.inference_mode()
    def step(self, doc_text: str | None, context: Sequence[int], k: int, ignore_eos: bool = False) -> StepOutput:
        """``f(doc, context, k)``: up to ``k`` greedy tokens after ``[doc][context]``.

        With ``ignore_eos`` the EOS logit is masked, so the step always yields ``k`` tokens.
        """
        if k <= 0:
            return StepOutput([], False, 0.0, 0.0, False)
        if not context:
            raise RalmInputError("context must contain at least one token")
        doc = self.doc_tokens(doc_text) if doc_text else ()
        if len(doc) + len(context) + k > self.max_positions:
            raise RalmInputError(
                f"document ({len(doc)}) + context ({len(context)}) + {k} new tokens exceed "
                f"the model's {self.max_positions} positions"
            )
        t0 = time.perf_counter()
        past, hit = self.doc_past(doc)
        ids = torch.tensor([list(context)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
        t1 = time.perf_counter()
        tokens: list[int] = []
        eos = False
        logits = out.logits[0, -1]
        past = out.past_key_values
        mask_eos = ignore_eos and self.eos_token_id is not None
        while True:
            scores = logits.float()
            if mask_eos:
                scores = scores.clone()
                scores[self.eos_token_id] = float("-inf")
            nxt = int(torch.argmax(scores))           # first index of the max: lowest id on ties
            if self.eos_token_id is not None and nxt == self.eos_token_id:
                eos = True
                break
            tokens.append(nxt)
            if len(tokens) >= k:
                break
            step_ids = torch.tensor([[nxt]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1], out.past_key_values
        t2 = time.perf_counter()
        return StepOutput(tokens, eos, t1 - t0, t2 - t1, hit)
