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

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypedDict

import torch

from cache.doc_kv import DocPrefixTree
from ralm.batching.attention_backend import attention_backend
from ralm.batching.continuous_batcher import ContinuousBatcher
from ralm.batching.doc_blocks import DocBlockCache
from ralm.batching.engine import BatchEngine, StepCall
from ralm.batching.invariant import InvariantUnavailable, make_invariant
from ralm.batching.iteration_graphs import IterationGraphs
from ralm.batching.kv_pool import KVPool, layer_devices
from ralm.batching.packed import model_max_positions
from ralm.batching.proof import InvarianceProof, prove_invariance
from ralm.batching.proof_cache import proof_cache_dir
from ralm.batching.sessions import SessionStore
from ralm.config import GeneratorConfig
from ralm.doc_kv import docs_past, last_logits_kwargs, segment_bytes
from ralm.drafting import DEFAULT_OPTIONS, StepOptions, greedy_scores
from ralm.drafting.decode import drafted_decode
from ralm.drafting.dense import DenseDrafter
from ralm.drafting.ngram import NGramDrafter
from ralm.errors import RalmInputError
from ralm.hf_cache import cache_kwargs, cache_of
from ralm.models import load_tokenizer_and_model, resolve
from ralm.step_output import StepOutput
from ralm.step_request import StepRequest, TextOf, doc_texts
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
        self.corpus: TextOf | None = None  # maps a StepRequest's doc_ids to text (attach_corpus)
        #: steps without the batcher run one at a time under this lock (a replica may swap in
        #: a null context to let them overlap: GeneratorDeploymentOptions.serialize_steps)
        self.step_lock: contextlib.AbstractContextManager = threading.Lock()
        self._lone: ThreadPoolExecutor | None = None
        self._lone_lock = threading.Lock()
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
                    self.model,
                    self.cfg.batch_max_sequences,
                    self.cfg.batch_token_budget,
                    cache_dir=proof_cache_dir() if self.cfg.proof_cache else None,
                )
                if not self.invariance_proof.ok:
                    raise InvariantUnavailable(str(self.invariance_proof.reason))
                log.info(
                    "invariance %s on %s/%s: %d comparisons in %.1f s",
                    "proof taken from the proof cache" if self.invariance_proof.cached else "proved",
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
        self.kv_pool_error: str | None = None  # why the KV cannot be paged on this model's placement
        self.doc_blocks: DocBlockCache | None = None
        if self.cfg.invariant and self.invariant_error is None:
            # each layer's KV on its layer's device (a model spread over several GPUs)
            devices = layer_devices(self.model)
            if devices is None and len({p.device for p in self.model.parameters()}) > 1:
                # every sequence's KV is paged, layer by layer on the layer's device: a model
                # whose layers do not say their index cannot be laid out, so it is not batched
                self.kv_pool_error = (
                    "the model's parameters are on several devices and its layers do not name their "
                    "index (layer_idx): the KV cannot be placed layer by layer, so steps run one at a time"
                )
                log.warning("continuous batching and KV sessions are off: %s", self.kv_pool_error)
        if self.cfg.invariant and self.batching_off_reason is None:
            if self.cfg.kv_pool:
                self.kv_pool = KVPool.for_model(self.model, devices=devices)
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
                devices=devices,
                graphs=self._iteration_graphs(),
            )
            self.batcher = ContinuousBatcher(self.batch)

    def _iteration_graphs(self) -> IterationGraphs | None:
        """The batched iterations' CUDA graphs (``generator.cuda_graphs``): on one CUDA device,
        with the Triton kernels (one paged launch per layer) and the KV pool; None elsewhere."""
        if not self.cfg.cuda_graphs or self.kv_pool is None or not attention_backend(self.model).paged_launch:
            return None
        if (
            {p.device.type for p in self.model.parameters()} != {"cuda"}
            or self.kv_pool.devices is not None
            and len(set(self.kv_pool.devices)) > 1
        ):
            return None  # one GPU: a graph is captured on one device's stream
        graphs = IterationGraphs(self.model, self.kv_pool)
        why = graphs.check()  # replayed against eager on this device, as the proof checks batching
        if why is not None:
            log.warning("CUDA graphs are off (batching stays on): %s", why)
        return graphs

    @property
    def batching_off_reason(self) -> str | None:
        """Why this engine does not batch although its config asks for it: a kernel that failed
        to compile or run, the whole-model proof's first failing check, or a placement the
        paged KV cannot follow; None when it serves as configured.
        Logged as a WARNING at load and reported in ``/v1/ralm/stats``; ``ralmspec gpu-check``
        exits non-zero on it."""
        return self.invariant_error or self.kv_pool_error

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
    def attach_dense_datastore(self, store) -> None:
        """The :class:`ralm.drafting.dense.DenseDatastore` used by ``drafting='dense'``."""
        self.dense_store = store

    def attach_corpus(self, corpus: TextOf) -> None:
        """The corpus that maps a :class:`~ralm.step_request.StepRequest`'s ``doc_ids`` to text."""
        self.corpus = corpus

    def drafter(self, docs: Sequence[tuple[int, ...]], opts: StepOptions):
        """The step's drafter (the one place one is built): n-gram drafts from the documents,
        dense drafts from the attached datastore, or None (no drafting)."""
        if opts.drafting == "ngram":
            return NGramDrafter(docs, opts.ngram_n, opts.ngram_m, opts.ngram_min_n)
        if opts.drafting == "dense":
            if self.dense_store is None:
                raise RalmInputError("drafting='dense' needs a datastore: engine.attach_dense_datastore(...)")
            return DenseDrafter(self.dense_store, opts.dense_num_drafts, opts.dense_draft_len, opts.dense_candidates)
        return None

    def _docs_of(self, req: StepRequest) -> list[tuple[int, ...]]:
        """The documents' token ids (truncated to ``max_doc_tokens``), after checking that the
        context is not empty and that ``[docs][context]`` plus ``k`` new tokens fit the model."""
        if not req.context:
            raise RalmInputError("context must contain at least one token")
        if req.doc_texts is not None:
            texts: list[str] = list(req.doc_texts)
        elif req.doc_ids is None:
            texts = []
        elif self.corpus is None:
            raise RalmInputError("a step by document ids needs a corpus: engine.attach_corpus(...)")
        else:
            texts = doc_texts(self.corpus, req.doc_ids, req.options)
        docs = [self.doc_tokens(t) for t in texts if t]
        self._check_fits(docs, req.context, req.k)
        return docs

    def _check_fits(self, docs: Sequence[Sequence[int]], context: Sequence[int], k: int) -> None:
        """Raise unless ``[docs][context]`` plus ``k`` new tokens fit the model's positions."""
        n_doc = sum(len(d) for d in docs)
        if n_doc + len(context) + k > self.max_positions:
            raise RalmInputError(
                f"document ({n_doc}) + context ({len(context)}) + {k} new tokens exceed "
                f"the model's {self.max_positions} positions"
            )

    def submit(self, req: StepRequest) -> Future[StepOutput]:
        """The engine's one entry: ``f(docs, context, k)`` of ``req``, as a future.

        Decides once how the step runs. With the invariant forward (the default) a plain,
        n-gram drafted or FLARE step joins the continuous batcher, which reuses the request's
        KV session (tagged ``req.owner``, freed by :meth:`release`) and shares forwards with
        concurrent steps; a dense-drafted step or one with inexact shifted doc-KV reuse runs
        alone on the batcher's thread between two iterations. Without the batcher
        (``invariant=false`` or a failed invariance proof) steps run alone on a worker
        thread, one at a time under :attr:`step_lock`. Bad input fails the future with
        :class:`~ralm.errors.RalmInputError`; ``k <= 0`` gives an empty output.
        """
        if req.k <= 0:
            done: Future[StepOutput] = Future()
            done.set_result(StepOutput([], False, 0.0, 0.0, False))
            return done
        opts = req.options or DEFAULT_OPTIONS
        try:
            docs = self._docs_of(req)
            drafter = self.drafter(docs, opts)
        except BaseException as e:  # the caller's error, in its own future
            failed: Future[StepOutput] = Future()
            failed.set_exception(e)
            return failed
        context = list(req.context)
        if self.batcher is not None:
            if opts.drafting in ("none", "ngram") and not opts.allow_inexact_shifted_reuse:
                call = StepCall(tuple(docs), context, req.k, req.ignore_eos, req.owner, req.options, drafter)
                return self.batcher.submit(call)
            return self.batcher.call(lambda: self._step_one(docs, context, req.k, req.ignore_eos, opts, drafter))
        return self._lone_pool().submit(self._step_locked, docs, context, req.k, req.ignore_eos, opts, drafter)

    def step(
        self,
        doc_text: str | Sequence[str] | None,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
        owner: str | None = None,
    ) -> StepOutput:
        """:meth:`submit` of the step on ``doc_text`` (a document's text, a list of them, or
        None), waited for: the in-process convenience for callers that hold the text."""
        texts = None if doc_text is None else ((doc_text,) if isinstance(doc_text, str) else tuple(doc_text))
        req = StepRequest(tuple(context), k, doc_texts=texts, ignore_eos=ignore_eos, options=options, owner=owner)
        return self.submit(req).result()

    def _lone_pool(self) -> ThreadPoolExecutor:
        with self._lone_lock:
            if self._lone is None:
                self._lone = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ralm-step")
            return self._lone

    def _step_locked(self, docs, context, k, ignore_eos, opts: StepOptions, drafter) -> StepOutput:
        with self.step_lock:
            return self._step_one(docs, context, k, ignore_eos, opts, drafter)

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
    def _step_one(self, docs, context, k, ignore_eos, opts: StepOptions, drafter=None) -> StepOutput:
        """One step on its own: documents' KV, one context prefill, greedy decode (drafted:
        :func:`~ralm.drafting.decode.drafted_decode` with ``drafter``, built here when None)."""
        t0 = time.perf_counter()
        past, info = docs_past(self, docs, opts.allow_inexact_shifted_reuse)
        kv = _KvStats(docs_reused=info.docs_reused, docs_computed=info.docs_computed, kv_bytes_reused=info.bytes_reused)
        if not opts.plain:
            drafter = drafter if drafter is not None else self.drafter(docs, opts)
            r = drafted_decode(self, past, context, k, ignore_eos, opts, drafter)
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
        out = self.model(
            input_ids=ids, use_cache=True, **cache_kwargs(self.model, past), **last_logits_kwargs(self.model)
        )
        t1 = time.perf_counter()
        tokens: list[int] = []
        eos = False
        logits = out.logits[0, -1]
        past = cache_of(out)
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
            out = self.model(input_ids=step_ids, use_cache=True, **cache_kwargs(self.model, past))
            logits, past = out.logits[0, -1], cache_of(out)
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
