"""Deterministic LM engine: the step ``f(doc, context_tokens, k) -> tokens``
(docs/design.md, "The exactness contract").

Prompt layout: ``[doc <= max_doc_tokens][question + generated so far]``, or with several
documents ``[doc1]..[docn][context]`` (their KV computed document by document and reused
through the doc-KV prefix tree, :mod:`ralm.doc_kv`). A step

1. takes the document's KV, computed from the document tokens alone and reused by
   token ids from a byte-bounded LRU (exact: the document is the prefix);
2. prefills the whole context (question + generated) on top of it in one forward pass,
   computing the logits of its last position only (``logits_to_keep=1``, as Hugging
   Face's ``generate`` does; the other positions' logits are never used);
3. decodes up to ``k`` tokens greedily (argmax; ties go to the lowest token id, which is
   what ``torch.argmax`` returns), stopping at EOS (EOS itself is not returned).

Options (:class:`ralm.drafting.StepOptions`): n-gram / dense drafting (same greedy tokens
up to float32 near-ties) and the FLARE stop; see :mod:`ralm.drafting.decode`.

The result depends only on ``(doc tokens, context tokens, k)``: the same bits whether the
doc KV came from the cache or was just computed, and whatever ran before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TypedDict

import torch

from cache.doc_kv import DocPrefixTree
from ralm.batching.continuous_batcher import ContinuousBatcher
from ralm.batching.doc_blocks import DocBlockCache
from ralm.batching.engine import BatchEngine, StepCall
from ralm.batching.invariant import InvariantUnavailable, make_invariant
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import model_max_positions
from ralm.batching.proof import InvarianceProof, prove_invariance
from ralm.batching.sessions import SessionStore
from ralm.config import GeneratorConfig
from ralm.doc_kv import docs_past, last_logits_kwargs, segment_bytes
from ralm.drafting import DEFAULT_OPTIONS, StepOptions, greedy_scores
from ralm.drafting.decode import drafted_decode
from ralm.drafting.dense import DenseDrafter
from ralm.drafting.ngram import NGramDrafter
from ralm.errors import RalmInputError
from ralm.models import load_tokenizer_and_model, resolve
from ralm.step_output import StepOutput
from ralm.tokens import decode as decode_ids, encode_question as question_ids

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _KvStats(TypedDict):
    """The multi-document KV reuse statistics of a step (keyword arguments of StepOutput)."""

    docs_reused: int
    docs_computed: int
    kv_bytes_reused: int


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
        self._eos_token_id: int | None = eos
        self.device = next(model.parameters()).device
        self.max_positions = model_max_positions(model.config)
        self.doc_kv = DocPrefixTree(self.cfg.doc_kv_cache_bytes, segment_bytes)
        self.dense_store = None  # DenseDatastore for drafting='dense' (attach_dense_datastore)
        self._doc_tok_memo: dict[str, tuple[int, ...]] = {}
        self.batch: BatchEngine | None = None
        self.batcher: ContinuousBatcher | None = None
        self.sessions = SessionStore(self.cfg.kv_session_bytes if self.cfg.invariant else 0)
        self.invariant_error: str | None = None  # why the invariant forward is off although asked for
        self.invariance_proof: InvarianceProof | None = None  # the whole-model proof (ralm.batching.proof)
        if self.cfg.invariant:
            try:
                make_invariant(self.model, self.cfg.invariant_tile_rows, self.cfg.invariant_kernels)
                # the kernels' probes passed: now the whole model, at the shapes the batcher will run
                self.invariance_proof = prove_invariance(
                    self.model, self.cfg.batch_max_sequences, self.cfg.batch_token_budget
                )
                if not self.invariance_proof.ok:
                    raise InvariantUnavailable(str(self.invariance_proof.reason))
                log.info(
                    "invariance proved on %s/%s: %d comparisons in %.1f s",
                    self.invariance_proof.device,
                    self.invariance_proof.dtype,
                    self.invariance_proof.comparisons,
                    self.invariance_proof.seconds,
                )
            except InvariantUnavailable as e:
                # keep serving: one step at a time, context re-prefilled (exact as before), and say why
                self.invariant_error = str(e)
                log.warning("continuous batching and KV sessions are off: %s", e)
        self.kv_pool: KVPool | None = None  # the batched engine's KV blocks (cfg.kv_pool)
        self.doc_blocks: DocBlockCache | None = None
        if self.cfg.invariant and self.invariant_error is None:
            if self.cfg.kv_pool:
                self.kv_pool = KVPool(int(self.model.config.num_hidden_layers))
                self.doc_blocks = DocBlockCache(self.cfg.doc_kv_cache_bytes)
                # no block free: idle sessions go first, then cached documents, then the pool grows
                self.kv_pool.reclaimers = [self.sessions.evict_one, self.doc_blocks.evict_one]
            self.batch = BatchEngine(
                self.model,
                self.eos_token_id,
                lambda docs: docs_past(self, docs),
                self.sessions,
                self.cfg.batch_token_budget,
                self.cfg.batch_max_sequences,
                pool=self.kv_pool,
                doc_blocks=self.doc_blocks,
                fast_draft=self.cfg.fast_draft,
            )
            self.batcher = ContinuousBatcher(self.batch)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self._eos_token_id = value
        if self.batch is not None:
            self.batch.eos_token_id = value

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_config(cls, cfg: GeneratorConfig) -> LMEngine:
        """Load ``cfg.model`` (a local path, a Hugging Face name, a GGUF file or a preset,
        see :mod:`ralm.models`) with its tokenizer."""
        src = resolve(cfg.model, cfg.gguf_file, cfg.model_sha256)
        kwargs: dict = {}
        if cfg.device == "auto":
            kwargs["device_map"] = "auto"  # spread layers over the visible GPUs
        try:
            tok, model = load_tokenizer_and_model(src, _DTYPES[cfg.dtype], cfg.dtype, **kwargs)
        except OSError as e:
            raise RalmInputError(f"cannot load generator {cfg.model!r}: {e}") from None
        if cfg.device != "auto":
            model = model.to(cfg.device)
        return cls(model, tok, cfg)

    # ------------------------------------------------------------------ text
    def encode_question(self, question: str) -> list[int]:
        """Token ids of a question; rejects empty, non-string and over-long input."""
        return question_ids(self.tokenizer, question, self.cfg.max_prompt_tokens)

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

    def decode(self, ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def _compute_doc_kv(self, doc: tuple[int, ...]):
        ids = torch.tensor([doc], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=True).past_key_values

    def doc_past(self, doc: tuple[int, ...]):
        """The document's KV (on a hit it shares the stored tensors, which the model's cache
        replaces on update and never writes into), and whether it hit."""
        if not doc:
            return None, False
        past, info = docs_past(self, [doc])
        return past, info.hit

    def attach_dense_datastore(self, store) -> None:
        """The :class:`ralm.drafting.dense.DenseDatastore` used by ``drafting='dense'``."""
        self.dense_store = store

    def _drafter(self, docs, context, opts: StepOptions):
        if opts.drafting == "ngram":
            return NGramDrafter(docs, opts.ngram_n, opts.ngram_m, opts.ngram_min_n)
        if opts.drafting == "dense":
            if self.dense_store is None:
                raise RalmInputError("drafting='dense' needs a datastore: engine.attach_dense_datastore(...)")
            return DenseDrafter(self.dense_store, opts.dense_num_drafts, opts.dense_draft_len, opts.dense_candidates)
        return None

    def _docs_for(self, doc_text: str | Sequence[str] | None, context: Sequence[int], k: int) -> list[tuple[int, ...]]:
        """The documents' token ids (truncated to ``max_doc_tokens``), after checking that the
        context is not empty and that ``[docs][context]`` plus ``k`` new tokens fit the model."""
        if not context:
            raise RalmInputError("context must contain at least one token")
        texts = [doc_text] if isinstance(doc_text, str) else list(doc_text or [])
        docs = [self.doc_tokens(t) for t in texts if t]
        self._check_fits(docs, context, k)
        return docs

    def _check_fits(self, docs: Sequence[Sequence[int]], context: Sequence[int], k: int) -> None:
        """Raise unless ``[docs][context]`` plus ``k`` new tokens fit the model's positions."""
        n_doc = sum(len(d) for d in docs)
        if n_doc + len(context) + k > self.max_positions:
            raise RalmInputError(
                f"document ({n_doc}) + context ({len(context)}) + {k} new tokens exceed "
                f"the model's {self.max_positions} positions"
            )

    def step_call(
        self,
        doc_text: str | Sequence[str] | None,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
        owner: str | None = None,
    ) -> StepCall | None:
        """The :class:`~ralm.batching.engine.StepCall` of a step the continuous batcher runs
        (``batcher.submit``), or None when it runs alone instead: no batcher
        (``invariant=false``), ``k <= 0``, dense drafting or inexact shifted doc-KV reuse
        (plain steps, n-gram drafting and the FLARE stop are batched).
        Raises :class:`~ralm.errors.RalmInputError` on bad input, as :meth:`step` does."""
        opts = options or DEFAULT_OPTIONS
        if self.batcher is None or k <= 0 or opts.drafting not in ("none", "ngram") or opts.allow_inexact_shifted_reuse:
            return None
        docs = self._docs_for(doc_text, context, k)
        return StepCall(tuple(docs), list(context), int(k), bool(ignore_eos), owner, options)

    @torch.inference_mode()
    def step(
        self,
        doc_text: str | Sequence[str] | None,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
        owner: str | None = None,
    ) -> StepOutput:
        """``f(doc, context, k)``: up to ``k`` greedy tokens after ``[doc][context]``.

        With the invariant forward (the default) a step goes through the continuous
        batcher (:meth:`step_call`), which reuses the request's KV session and batches it with
        concurrent steps; ``owner`` tags the session so :meth:`release` can free it when the
        request ends. Other steps run alone (:meth:`step_alone`), on the batcher's thread when
        there is one.

        ``doc_text`` may be a list of documents: the prompt is ``[doc1]..[docn][context]``.
        With ``ignore_eos`` the EOS logit is masked, so the step always yields ``k`` tokens.
        ``options`` selects drafting / the FLARE stop (default: the plain greedy loop).
        """
        if k <= 0:
            return StepOutput([], False, 0.0, 0.0, False)
        call = self.step_call(doc_text, context, k, ignore_eos, options, owner)
        if call is not None and self.batcher is not None:
            return self.batcher.submit(call).result()
        if self.batcher is not None:
            # dense drafting (several drafts, hidden states): one sequence, on the model's thread
            return self.batcher.call(lambda: self.step_alone(doc_text, context, k, ignore_eos, options)).result()
        return self.step_alone(doc_text, context, k, ignore_eos, options)

    @torch.inference_mode()
    def step_alone(
        self,
        doc_text: str | Sequence[str] | None,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
    ) -> StepOutput:
        """The step on the calling thread, outside the batcher. The caller must own the model:
        run it on the batcher's thread (``batcher.call``) when there is a batcher."""
        if k <= 0:
            return StepOutput([], False, 0.0, 0.0, False)
        docs = self._docs_for(doc_text, context, k)
        return self._step_one(docs, context, k, ignore_eos, options or DEFAULT_OPTIONS)

    def step_batch(self, calls: Sequence[StepCall]) -> list[StepOutput]:
        """Run several plain steps together (one batched forward per iteration); each output
        is the one the step gives alone. Needs ``invariant=True``."""
        if self.batcher is None:
            raise RalmInputError("step_batch needs the invariant forward (generator.invariant=true)")
        for c in calls:
            self._check_fits(c.docs, c.context, c.k)
        return self.batcher.step_batch(calls)

    def release(self, owner: str) -> int:
        """Free the KV sessions of a request that ended or was cancelled."""
        return self.sessions.release(owner)

    def clear_kv_caches(self) -> None:
        """Forget every cached KV: documents (both caches) and sessions (benchmarks start cold)."""
        self.doc_kv.clear()
        if self.doc_blocks is not None:
            self.doc_blocks.clear()
        self.sessions.clear()

    @torch.inference_mode()
    def _step_one(self, docs, context, k, ignore_eos, opts: StepOptions) -> StepOutput:
        """One step on its own: documents' KV, one context prefill, greedy decode."""
        t0 = time.perf_counter()
        past, info = docs_past(self, docs, opts.allow_inexact_shifted_reuse)
        kv = _KvStats(docs_reused=info.docs_reused, docs_computed=info.docs_computed, kv_bytes_reused=info.bytes_reused)
        if not opts.plain:
            r = drafted_decode(self, past, context, k, ignore_eos, opts, self._drafter(docs, context, opts))
            t2 = time.perf_counter()
            return StepOutput(
                r.tokens,
                r.eos,
                r.prefill_end - t0,
                t2 - r.prefill_end,
                info.hit,
                forward_passes=r.forward_passes,
                draft_rounds=r.draft_rounds,
                drafted_tokens=r.drafted_tokens,
                accepted_tokens=r.accepted_tokens,
                low_confidence=r.low_confidence,
                **kv,
            )
        hit = info.hit
        ids = torch.tensor([list(context)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=past, use_cache=True, **last_logits_kwargs(self.model))
        t1 = time.perf_counter()
        tokens: list[int] = []
        eos = False
        logits = out.logits[0, -1]
        past = out.past_key_values
        while True:
            scores = greedy_scores(logits, self.eos_token_id, ignore_eos)
            nxt = int(torch.argmax(scores))  # first index of the max: lowest id on ties
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
        return StepOutput(
            tokens,
            eos,
            t1 - t0,
            t2 - t1,
            hit,
            forward_passes=max(1, len(tokens) + int(eos)),
            context_computed=len(context),
            **kv,
        )
