"""The batched step engine: many ``f(docs, context, k)`` steps advanced together.

Each step is a small state machine:

1. **start**: take the request's KV session (:mod:`ralm.batching.sessions`) or build one
   from the doc-KV cache; the context tokens the session lacks become *pending*;
2. **prefill**: pending tokens are fed in chunks (as much as the iteration's token budget
   allows); when the last pending token has been fed, its logits give the next token;
3. **decode**: each new token is fed alone, one per iteration, until ``k`` tokens or EOS;
4. **finish**: the session goes back to the store (its context now includes the tokens
   generated, except the last one, whose KV was never needed).

:meth:`BatchEngine.iterate` runs one packed forward over all active steps: decode tokens
first (one each), then prefill chunks in arrival order, up to ``token_budget`` tokens and
``max_sequences`` sequences (the policy: :func:`ralm.batching.policy.plan_iteration`).
Greedy choice is that of the plain engine: ``argmax`` of the float32 logits (lowest id on
ties), EOS masked with ``ignore_eos``, EOS not returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ralm import constants as C
from ralm.batching.attention_backend import attention_backend
from ralm.batching.doc_blocks import DocBlockCache
from ralm.batching.fast_draft import draft_round, draftable
from ralm.batching.iteration_graphs import IterationGraphs
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.batching.policy import plan_iteration
from ralm.batching.sessions import DocsKey, Session, SessionStore
from ralm.doc_kv import DocsKVInfo
from ralm.drafting import StepOptions, greedy_scores, greedy_tokens
from ralm.errors import RalmInputError
from ralm.step_output import StepOutput


@dataclass
class StepCall:
    """One step as the batched engine runs it: up to ``k`` greedy tokens after ``[docs][context]``
    (a :class:`~ralm.step_request.StepRequest` with its documents resolved to token ids by
    :meth:`ralm.engine.LMEngine.submit`)."""

    docs: DocsKey  # tuple of documents, each a tuple of token ids (empty: no document)
    context: list[int]
    k: int
    ignore_eos: bool = False
    owner: str | None = None  # the request the session belongs to (freed with SessionStore.release)
    options: StepOptions | None = None  # n-gram drafting and the FLARE stop (None: plain greedy)
    drafter: Any = None  # the n-gram drafter of ``options`` (built by LMEngine.drafter)


@dataclass
class FeedCall:
    """Feed ``tokens`` to a caller-owned sequence ``kv`` and return the last token's logits and
    final hidden state (a KNN-LM step: the query and the LM distribution); no generation."""

    kv: PagedKV
    tokens: list[int]


@dataclass
class FeedOutput:
    logits: torch.Tensor  # [vocab], after the last token fed
    hidden: torch.Tensor  # [d], the final hidden state there


@dataclass
class ActiveStep:
    """A step in progress (engine-internal state, exposed for the continuous batcher, the policy and tests)."""

    call: StepCall
    session: Session
    pending: list[int]
    t_start: float
    tokens: list[int] = field(default_factory=list)
    eos: bool = False
    done: bool = False
    t_first: float | None = None
    forward_passes: int = 0
    doc_kv_hit: bool = False
    docs_reused: int = 0
    docs_computed: int = 0
    kv_bytes_reused: int = 0
    context_reused: int = 0
    context_computed: int = 0
    feed: FeedOutput | None = None  # a FeedCall's result (feed calls generate nothing)
    is_feed: bool = False
    drafter: Any = None  # n-gram drafter (options.drafting == "ngram")
    verify: list[int] | None = None  # the draft fed after pending[0], checked when its logits come
    draft_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    low_confidence: bool = False


@dataclass
class IterationStats:
    """What one batched forward held."""

    sequences: int  # sequences in the forward
    tokens: int  # tokens fed (prefill chunks, decode tokens, drafts)
    seconds: float  # wall time of the iteration
    generated: int = 0  # new tokens the iteration produced
    forward_s: float = 0.0  # of ``seconds``, the model's forward (on a GPU: its kernels' span on the stream)


class BatchEngine:
    """Advances :class:`StepCall` s together through packed, invariant forward passes.

    ``model``: a model rewritten by :func:`ralm.batching.invariant.make_invariant`;
    ``docs_kv(docs) -> (hf_cache | None, info)``: the documents' KV from the doc-KV prefix
    tree (without the pool; with it, documents are computed into the pool, ``doc_blocks``);
    ``sessions``: the session store; ``pool``: the KV pool every step's sequence lives in
    (None: every sequence in a pool of its own, :meth:`PagedKV.standalone`, laid out on
    ``devices``, each layer's device), with ``doc_blocks``, the documents' KV kept in it;
    ``fast_draft``: tokens drafted per decode round on the plain kernels and verified by the
    invariant forward (:mod:`ralm.batching.fast_draft`; 0: off); ``graphs``: iterations
    replayed as CUDA graphs (:mod:`ralm.batching.iteration_graphs`; None: every forward eager;
    a KNN-LM feed's iteration, which returns hidden states too, always runs eagerly).
    """

    def __init__(
        self,
        model,
        eos_token_id: int | None,
        docs_kv: Callable,
        sessions: SessionStore,
        token_budget: int = C.BATCH_TOKEN_BUDGET,
        max_sequences: int = C.BATCH_MAX_SEQUENCES,
        pool: KVPool | None = None,
        doc_blocks: DocBlockCache | None = None,
        fast_draft: int = 0,
        devices: Sequence[torch.device] | None = None,
        graphs: IterationGraphs | None = None,
    ):
        self.model = model
        self.graphs = graphs
        self.devices = devices
        self.value_ones = attention_backend(model).value_ones  # the values' layout its attention reads
        self.device = next(model.parameters()).device
        self.fast_draft = int(fast_draft)
        self.pool = pool
        self.doc_blocks = doc_blocks if doc_blocks is not None else DocBlockCache(0)
        self.eos_token_id = eos_token_id
        self.docs_kv = docs_kv
        self.sessions = sessions
        self.token_budget = int(token_budget)
        self.max_sequences = int(max_sequences)
        self.n_layers = int(model.config.num_hidden_layers)
        self.on_iteration: Callable[[IterationStats], None] | None = None

    # ------------------------------------------------------------------ start / finish
    def start(self, call: StepCall | FeedCall) -> ActiveStep:
        """Find or build the step's session and its pending tokens (no forward for the context)."""
        if isinstance(call, FeedCall):
            if not call.tokens:
                raise RalmInputError("a feed needs at least one token")
            own = Session((), 0, [], call.kv)
            return ActiveStep(
                StepCall((), [0], 1), own, [int(t) for t in call.tokens], time.perf_counter(), is_feed=True
            )
        if call.k <= 0:
            raise RalmInputError("k must be positive")
        if not call.context:
            raise RalmInputError("context must contain at least one token")
        drafting = call.options.drafting if call.options is not None else "none"
        if drafting not in ("none", "ngram") or (drafting == "ngram") != (call.drafter is not None):
            raise RalmInputError(f"drafting={drafting!r} is not run by the batched engine without its n-gram drafter")
        drafter = call.drafter
        t0 = time.perf_counter()
        ctx = [int(t) for t in call.context]
        sess, reuse = self.sessions.take(call.docs, ctx)
        hit = True
        reused = computed = bytes_reused = 0
        if sess is None:
            kv, info = self._docs_kv(call.docs)
            sess = Session(call.docs, len(kv), [], kv, call.owner)
            hit = info.hit
            reused, computed, bytes_reused = info.docs_reused, info.docs_computed, info.bytes_reused
            reuse = 0
        else:  # the documents' KV comes with the session
            reused = len(call.docs)
            bytes_reused = sess.doc_len * sess.kv.bytes_per_position()
        reuse = min(reuse, len(ctx) - 1)  # the last context token is always fed: its logits start the step
        sess.kv.crop(sess.doc_len + reuse)
        sess.context = ctx[:reuse]
        sess.owner = call.owner if call.owner is not None else sess.owner
        self.sessions.stats.reused_tokens += reuse
        return ActiveStep(
            call,
            sess,
            ctx[reuse:],
            t0,
            doc_kv_hit=hit,
            docs_reused=reused,
            docs_computed=computed,
            kv_bytes_reused=bytes_reused,
            context_reused=reuse,
            context_computed=len(ctx) - reuse,
            drafter=drafter,
        )

    def _docs_kv(self, docs: DocsKey) -> tuple[PagedKV, DocsKVInfo]:
        """A new sequence holding the documents' KV.

        In the pool: a fork of the longest cached prefix of the document sequence, the other
        documents computed on top of it straight into the pool, one at a time (in chunks of
        the token budget: chunk invariance makes them the bits of one pass), each new prefix
        cached as a fork, so the pool's blocks are the documents' only copy. Without the
        pool: a copy of the doc-KV prefix tree's tensors, in a pool of the sequence's own."""
        if self.pool is None:
            past, info = self.docs_kv(docs)
            return PagedKV.from_cache(self.sequence_pool(), past), info
        docs = tuple(tuple(d) for d in docs if d)
        kv, n = self.doc_blocks.fork_longest(docs) if docs else (None, 0)
        if kv is None:
            kv = PagedKV(self.pool)
        bpp = kv.bytes_per_position() if self.pool.allocated else 0
        info = DocsKVInfo(bool(docs) and n == len(docs), n, len(docs) - n, len(kv) * bpp)
        B = self.pool.block_size
        try:
            for j in range(n, len(docs)):
                shared = len(kv) // B  # the prefix's full blocks, the new entry shares them
                doc = list(docs[j])
                for s in range(0, len(doc), self.token_budget):
                    packed_forward(self.model, [(kv, doc[s : s + self.token_budget])])
                if self.doc_blocks.capacity_bytes > 0:
                    self.doc_blocks.put(docs[: j + 1], kv.fork(), (len(kv.table) - shared) * self.pool.block_bytes)
        except BaseException:
            kv.free()
            raise
        return kv, info

    def sequence_pool(self) -> KVPool:
        """Where a new sequence of this engine lives: the engine's KV pool, or (without one) a
        pool of the sequence's own, laid out as the model's layers and attention need."""
        if self.pool is not None:
            return self.pool
        return KVPool.of_one_sequence(self.n_layers, self.devices, self.value_ones)

    def abandon(self, a: ActiveStep) -> None:
        """Free the KV of a step that will not finish (its forward failed): a session's pool
        blocks go back; a feed's sequence is the caller's."""
        if not a.is_feed:
            a.session.drop()

    def finish(self, a: ActiveStep):
        """Give the session back and build the step's :class:`~ralm.engine.StepOutput` (a feed:
        its :class:`FeedOutput`; the sequence stays the caller's)."""
        if a.is_feed:
            return a.feed
        self.sessions.put(a.session)
        t_end = time.perf_counter()
        t_first = a.t_first if a.t_first is not None else t_end
        return StepOutput(
            list(a.tokens),
            a.eos,
            t_first - a.t_start,
            t_end - t_first,
            a.doc_kv_hit,
            forward_passes=a.forward_passes,
            docs_reused=a.docs_reused,
            docs_computed=a.docs_computed,
            kv_bytes_reused=a.kv_bytes_reused,
            context_reused=a.context_reused,
            context_computed=a.context_computed,
            draft_rounds=a.draft_rounds,
            drafted_tokens=a.drafted_tokens,
            accepted_tokens=a.accepted_tokens,
            low_confidence=a.low_confidence,
        )

    # ------------------------------------------------------------------ one iteration
    @torch.inference_mode()
    def iterate(self, active: Sequence[ActiveStep]) -> IterationStats:
        """One packed forward over (some of) ``active``; marks the steps that finish ``done``."""
        t0 = time.perf_counter()
        draft_s = 0.0
        if self.fast_draft > 0:  # decode fast, verify exactly (ralm.batching.fast_draft)
            ready = [a for a in active if draftable(a)][: self.max_sequences]
            if ready:
                draft_s = draft_round(self.model, ready, self.fast_draft, self.eos_token_id)
        plan = plan_iteration(active, self.token_budget, self.max_sequences)
        if not plan:
            return IterationStats(0, 0, 0.0)
        chunks: list[tuple[PagedKV, list[int]]] = [(c.step.session.kv, c.step.pending[: c.tokens]) for c in plan]
        rows = plan.logit_rows
        # (step, its first row among the logits, rows): in the order of ``rows``
        emitting: list[tuple[ActiveStep, int, int]] = []
        at = 0
        for c in plan:
            if c.logit_rows:
                emitting.append((c.step, at, c.logit_rows))
                at += c.logit_rows
        hidden = None
        # on a GPU the forward's time is its kernels' span on the stream, read from two events
        # after the iteration's one synchronisation (the greedy tokens' transfer); on a CPU it
        # is the call's wall time
        events = _cuda_events(self.device)
        t_fwd = time.perf_counter()
        if events is not None:
            events[0].record()
        if any(a.is_feed for a, _, _ in emitting):
            logits, hidden = packed_forward(self.model, chunks, rows, with_hidden=True)
        else:
            logits = self.graphs.forward(chunks, rows) if self.graphs is not None else None
            if logits is None:  # not an iteration a graph replays
                logits = packed_forward(self.model, chunks, rows)
        if events is not None:
            events[1].record()
        forward_s = time.perf_counter() - t_fwd
        for c in plan:
            a = c.step
            a.session.context.extend(a.pending[: c.tokens])
            a.pending = a.pending[c.tokens :]
            a.forward_passes += 1
        before = sum(len(a.tokens) for a, _, _ in emitting)
        preds = self._greedy(logits, emitting)  # the iteration's one host synchronisation
        if events is not None:
            forward_s = event_span_s(events, forward_s)
        forward_s += draft_s
        for a, row, n in emitting:
            if a.is_feed:
                a.feed = FeedOutput(logits[row], hidden[row])  # type: ignore[index]
                a.done = True
            elif a.verify is not None:
                self._emit_verified(a, logits[row : row + n], preds[row : row + n])
            else:
                self._emit(a, logits[row], preds[row])
        made = sum(len(a.tokens) for a, _, _ in emitting) - before
        st = IterationStats(len(plan), plan.tokens, time.perf_counter() - t0, made, forward_s)
        if self.on_iteration is not None:
            self.on_iteration(st)
        return st

    def _greedy(self, logits: torch.Tensor, emitting: Sequence[tuple[ActiveStep, int, int]]) -> list[int]:
        """The greedy token of every emitting row of ``logits [R, vocab]``, in one transfer
        (:func:`~ralm.drafting.greedy_tokens`; EOS masked in the rows of ``ignore_eos`` steps)."""
        rows = [r for a, row, n in emitting if a.call.ignore_eos and not a.is_feed for r in range(row, row + n)]
        return greedy_tokens(logits, self.eos_token_id, rows)

    def _scores(self, a: ActiveStep, logits: torch.Tensor) -> torch.Tensor:
        return greedy_scores(logits, self.eos_token_id, a.call.ignore_eos)

    def _low_confidence(self, a: ActiveStep, logits: torch.Tensor, token: int) -> bool:
        """FLARE's stop: the greedy token's probability (softmax of the row alone, as the
        single-sequence decoder computes it) under the step's threshold."""
        thr = a.call.options.flare_threshold if a.call.options is not None else None
        return thr is not None and float(torch.softmax(self._scores(a, logits), dim=-1)[token]) < thr

    def _emit(self, a: ActiveStep, logits: torch.Tensor, nxt: int) -> None:
        """The next token ``nxt`` (the greedy choice of ``logits [vocab]``): EOS ends the step;
        with FLARE, so does a low-probability token (after the first); with a drafter, the
        next chunk carries a draft."""
        if a.t_first is None:
            a.t_first = time.perf_counter()
        if self.eos_token_id is not None and nxt == self.eos_token_id:
            a.eos = a.done = True
            return
        if a.tokens and self._low_confidence(a, logits, nxt):
            a.low_confidence = a.done = True
            return
        a.tokens.append(nxt)
        if len(a.tokens) >= a.call.k:
            a.done = True
            return
        a.pending = [nxt]
        m = a.call.k - len(a.tokens) - 1
        if a.drafter is not None and m > 0:
            drafts = a.drafter.propose(list(a.call.context) + a.tokens, None, nxt, m)
            draft = list(drafts[0][:m]) if drafts and len(drafts[0]) else []
            if draft:
                a.pending, a.verify = [nxt, *draft], draft

    def _emit_verified(self, a: ActiveStep, logits: torch.Tensor, preds: list[int]) -> None:
        """``logits [1 + len(draft), vocab]`` of ``[nxt, draft...]`` and their greedy tokens
        ``preds``: accept the draft while it equals the argmax (and passes FLARE), drop the KV
        of the rest, then emit the token after the last accepted one. With the invariant
        forward each row is the logit vector one-token decoding would give, so the tokens are
        plain greedy decoding's."""
        draft, a.verify = a.verify or [], None
        acc = 0
        while acc < len(draft) and draft[acc] == preds[acc] and draft[acc] != self.eos_token_id:
            if self._low_confidence(a, logits[acc], draft[acc]):
                break
            acc += 1
        a.draft_rounds += 1
        a.drafted_tokens += len(draft)
        a.accepted_tokens += acc
        drop = len(draft) - acc
        if drop:
            a.session.kv.crop(len(a.session.kv) - drop)
            del a.session.context[-drop:]
        a.tokens.extend(draft[:acc])
        self._emit(a, logits[acc], preds[acc])


def event_span_s(events: tuple, wall_s: float) -> float:
    """Seconds between two recorded CUDA events, once the second has completed; ``wall_s``
    (the host's time for the launches) when it has not. An iteration in which no row emits
    (every chunk a partial prefill) transfers no greedy tokens, so nothing has waited for its
    kernels, and ``elapsed_time`` on an unfinished event raises: the timer never blocks the
    iteration for a number."""
    start, end = events
    if not end.query():
        return wall_s
    return start.elapsed_time(end) / 1e3


def _cuda_events(device: torch.device) -> tuple | None:
    """Two timing events on a CUDA ``device`` (None on a CPU)."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
