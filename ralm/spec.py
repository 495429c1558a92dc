"""RaLMSpec: speculative retrieval with batched verification (RaLMSpec paper, Algorithm 1).

Each step retrieves from a small per-request cache instead of the KB; every ``s`` steps
one batched KB call verifies them, and the first wrong step and everything after it is
rolled back and regenerated with the KB's document. The cycle itself is
:func:`ralm.speculation_cycle.speculate`; this module is its document-level strategy
(:class:`_SpecRun`: a step is ``f(doc, X, k)``). Options, independent of each other:

- P (prefetch): insert the KB's top-p documents into the cache, not only the top-1;
- S (OS3): choose ``s`` adaptively (:mod:`ralm.stride.os3`);
- A (async): while a verification is in flight (a real thread: FAISS, Lucene and torch
  release the GIL), run the next speculative step. If the window verifies, that step
  becomes the first step of the next window; otherwise it is discarded.

Step 0 runs on the warm-up KB answer (its own query's top-1), so it is never speculated
or re-verified (see :meth:`_SpecRun.first_step`).

Exactness: every committed step's document is the KB's top-1 for its query, and every
step is ``f(doc, X, k)`` over the same ``X`` RaLMSeq would have, so the tokens are equal
(the argument in full: :mod:`ralm.speculation_cycle`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from cache.speculative import SpeculativeCache
from ralm.config import RequestConfig, SpecConfig
from ralm.generator import Generator
from ralm.results import RalmResult, RequestStats, VerifiedPrefix
from ralm.retrieval.base import Hit, Retriever, SharedKB
from ralm.seq import apply_resume, finish
from ralm.speculation_cycle import speculate
from ralm.stride.gamma_prior import PROCESS_PRIOR
from ralm.stride.load_gate import SharedLoadGate
from ralm.stride.os3 import StrideScheduler
from ralm.stride.shadow_budget import ShadowBudget
from ralm.stride.workloads import call_step, doc_from_hits, make_query_fn, retrieval_depth, step_budget, steps_left

_POOL: ThreadPoolExecutor | None = None


def _default_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ralm-verify")
    return _POOL


@dataclass
class _Step:
    query: str
    doc_id: int | None  # speculated document
    mark: int  # len(X) before the step
    eos: bool


def _timed_batch_search(kb: Retriever, queries: Sequence[str], k: int) -> tuple[list[list[Hit]], float]:
    t0 = time.perf_counter()
    res = kb.batch_search(list(queries), k)
    return res, time.perf_counter() - t0


class _SpecRun:
    """State of one RaLMSpec request: the document-level :class:`~ralm.speculation_cycle.Strategy`.

    A step's value is its document (``doc_from_hits``: the ranked ids the step uses); the
    truth of a window is the KB's top-p of each query, all of which are cached.
    """

    def __init__(
        self,
        question: str,
        gen: Generator,
        kb: Retriever,
        req: RequestConfig,
        spec: SpecConfig,
        cache: SpeculativeCache | None,
        on_commit: Callable[[list[int]], None] | None = None,
        resume: VerifiedPrefix | None = None,
        on_verified: Callable[[list[int], list, bool], None] | None = None,
    ):
        self.gen, self.kb, self.req, self.spec = gen, kb, req, spec
        self.on_commit = on_commit
        self.on_verified = on_verified
        self.t_start = time.perf_counter()
        self.X: list[int] = gen.encode_question(question)
        self.n_q = len(self.X)
        self.emitted = self.n_q  # X[:emitted] was passed to on_commit
        self.eos = False
        self.cache = cache if cache is not None else SpeculativeCache(kb.scorer)
        self.depth = retrieval_depth(req)  # ranked ids a step uses (1 unless num_docs > 1 / IDGR)
        self.p = max(spec.prefetch_size if spec.prefetch else 1, self.depth)
        self.query = make_query_fn(gen, req, self.n_q)
        self.sched = StrideScheduler(
            spec,
            prior=PROCESS_PRIOR if spec.gamma_prior else None,
            prior_key=("doc", kb.name, spec.model_dump_json()),
            cost_curve=getattr(kb, "batch_cost_curve", None),  # the KB's start-up batch timings
        )
        self.async_verify = spec.async_verify
        # direct steps while many requests share the KB (adaptive strides only: a fixed stride is
        # what the caller asked for)
        self.gate = (
            SharedLoadGate(self.sched, kb, spec.shared_kb_direct_at, spec.shared_kb_cost_model)
            if spec.adaptive_stride
            else None
        )
        self.shared_kb = kb if isinstance(kb, SharedKB) else None  # told when a window opens
        self.probe_budget = ShadowBudget(("doc", getattr(kb, "name", ""), self.depth))  # direct steps' guesses
        name = (
            "".join(c for c, on in (("P", spec.prefetch), ("S", spec.adaptive_stride), ("A", spec.async_verify)) if on)
            or "base"
        )
        self.stats = RequestStats(method=f"spec[{name}]", retriever=getattr(kb, "name", "")).set_request(req)
        if resume is not None:  # start from a verified prefix (steps are deterministic)
            self.X, self.eos = apply_resume(resume, self.X, self.stats, req.max_new_tokens)
            self.emitted = len(self.X)

    # ---- helpers
    @property
    def finished(self) -> bool:
        return self.eos or len(self.X) - self.n_q >= self.req.max_new_tokens

    def remaining_steps(self) -> int:
        return 0 if self.eos else steps_left(self.req, len(self.X) - self.n_q)

    def _generate(self, doc_id: int | None) -> tuple[int, bool]:
        """Run f(doc, X, k) and append its tokens; returns (mark, eos)."""
        mark = len(self.X)
        k = step_budget(self.req, mark - self.n_q)
        t0 = time.perf_counter()
        out = call_step(self.gen, doc_id, self.X, k, self.req)
        dt = time.perf_counter() - t0
        self.stats.record_step(out)
        self.stats.gen_time_s += dt
        self.sched.record_generation(dt)
        self.stats.doc_kv_hits += int(out.doc_kv_hit)
        self.X = self.X + out.tokens
        self.eos = out.eos
        return mark, out.eos

    def _add_to_cache(self, hits_per_query: Sequence[Sequence[Hit]]) -> None:
        self.cache.add([d for hits in hits_per_query for d, _ in hits])

    def speculative_step(self) -> _Step:
        t0 = time.perf_counter()
        q = self.query(self.X)
        rep = self.kb.scorer.encode([q])[0]
        doc_id = doc_from_hits(self.cache.search(rep, self.depth), self.req)
        self.stats.cache_lookups += 1
        mark, eos = self._generate(doc_id)
        self.stats.spec_steps += 1
        self.sched.record_step(time.perf_counter() - t0)
        return _Step(q, doc_id, mark, eos)

    def window_opens(self) -> None:
        """A window of speculative steps starts: a shared KB need not wait for this request's
        next call to form a batch (:class:`~ralm.retrieval.base.SharedKB`)."""
        if self.shared_kb is not None:
            self.shared_kb.speculating()

    def emit(self, pending: _Step | None) -> None:
        """Pass newly verified tokens to ``on_commit`` (all of X except a pending async step),
        and the whole verified prefix to ``on_verified``."""
        if self.on_commit is None and self.on_verified is None:
            return
        upto = pending.mark if pending is not None else len(self.X)
        if upto > self.emitted:
            chunk = self.X[self.emitted : upto]
            self.emitted = upto
            if self.on_commit is not None:
                self.on_commit(list(chunk))
            if self.on_verified is not None:
                self.on_verified(self.X[self.n_q : upto], list(self.stats.doc_ids), self.eos and pending is None)

    def _commit_kb_step(self, hits: Sequence[Hit]) -> int:
        """Run a step on the KB's own ranking ``hits`` for the current query (already a
        verified step: nothing to speculate, nothing to re-check). Returns its document."""
        doc_id = doc_from_hits(hits, self.req)
        self._generate(doc_id)
        self.stats.doc_ids.append(doc_id)
        return doc_id

    def first_step(self) -> None:
        """Step 0 on the KB's answer for the question, which also warms the cache.

        Algorithm 1 warms the cache with ``KB.search(query(X))`` and then speculates
        step 0 from it. That query is step 0's query, so its top-1 *is* step 0's document:
        speculating it could only ever match, and re-sending it in the first verification
        costs a whole KB call (the first window has s = 1). So step 0 commits straight
        away. It gives OS3 its first measurements, split the way a speculative window
        spends them: the query encoding (a speculative step pays it; the KB search then
        reuses the memoised vector) and the search itself, a b(1) sample. It is not a
        gamma observation (the cache could not have been wrong)."""
        q = self.query(self.X)
        t0 = time.perf_counter()
        self.kb.scorer.encode([q])
        t1 = time.perf_counter()
        first = self.kb.search(q, self.p)  # reuses the memoised vector (dense)
        self.sched.record_lookup(t1 - t0)
        self.sched.record_kb_latency(1, time.perf_counter() - t1)
        self._add_to_cache([first])
        self._commit_kb_step(first)

    def direct_step(self) -> None:
        """s = 0: a plain RaLMSeq step (KB top-1, then f).

        On a *probe* the cache first guesses the step's document, and OS3 hears whether
        the guess was the KB's answer, so gamma stays current while no window runs. The
        guess encodes the query (memoised by both scorers, so the KB search that follows
        reuses it) and looks it up in the cache; the lookup is overhead RaLMSeq does not
        pay, so probes are rationed by the shadow budget
        (:class:`~ralm.stride.shadow_budget.ShadowBudget`, lookups within 5% of the direct steps'
        KB time). The KB's answer always joins the cache (an insertion costs ~15 us). A direct
        step the load gate chose (:mod:`ralm.stride.load_gate`) is RaLMSeq's alone: no probe, no
        insertion."""
        st = self.stats
        q = self.query(self.X)
        if self.gate is not None and self.gate.gating:  # the KB is crowded: RaLMSeq's step, no cache work
            hits = self.kb.search(q, self.depth)
            self._commit_kb_step(hits)
            return
        probe = self.probe_budget.allowed()
        guess, lookup, t_cache = None, None, 0.0
        t0 = time.perf_counter()
        if probe:
            rep = self.kb.scorer.encode([q])[0]
            t1 = time.perf_counter()
            guess = doc_from_hits(self.cache.search(rep, self.depth), self.req)
            t2 = time.perf_counter()
            lookup, t_cache = t2 - t0, t2 - t1  # a speculative step's lookup part; the overhead
            self.probe_budget.spend(t_cache)
            st.cache_lookups += 1
        # only the documents the step uses: prefetching top-p here would cost cache
        # insertions (e.g. BM25 term vectors) on every step of a regime chosen precisely
        # because retrieval is cheap; the next verification prefetches again
        hits = self.kb.search(q, self.depth)
        b = time.perf_counter() - t0
        self.probe_budget.add_kb_time(b - t_cache)
        self._add_to_cache([hits])
        doc_id = self._commit_kb_step(hits)
        if probe:
            st.shadow_hits += int(guess == doc_id)
        self.sched.record_direct(guess == doc_id if probe else None, b, lookup)

    # ---- verification (the KB's top-p of each window query; its top-1 is the truth)
    def verify(self, window: Sequence[_Step]) -> tuple[list[list[Hit]], float]:
        return _timed_batch_search(self.kb, [w.query for w in window], self.p)

    def first_mismatch(self, window: Sequence[_Step], truth: Sequence[Sequence[Hit]]) -> tuple[int, object] | None:
        for i, (w, t) in enumerate(zip(window, truth)):
            right = doc_from_hits(t, self.req)
            if w.doc_id != right:
                return i, right
        return None

    def cache_truth(self, truth: Sequence[Sequence[Hit]], upto: int) -> None:
        self._add_to_cache(truth)  # every answer, also those after a mismatch

    def accept(self, steps: Sequence[_Step]) -> None:
        self.stats.doc_ids.extend(w.doc_id for w in steps)

    def rollback(self, step: _Step) -> int:
        dropped = len(self.X) - step.mark
        self.X = self.X[: step.mark]
        self.eos = False
        return dropped

    def commit_correction(self, doc_id) -> None:
        self._generate(doc_id)  # correction step with the KB's document
        self.stats.doc_ids.append(doc_id)

    def run(self, executor: Executor) -> RalmResult:
        sched = self.sched if self.gate is None else cast(StrideScheduler, self.gate)  # the same interface
        speculate(self, sched, self.stats, executor)
        if self.gate is not None:
            self.stats.load_direct_steps = self.gate.gated
            self.stats.stride_reasons = dict(self.gate.reasons)
            self.stats.shared_queries = self.gate.others if self.shared_kb is not None else None
        return finish(self.gen, self.n_q, self.X, self.eos, self.stats, self.t_start)


def run_spec(
    question: str,
    gen: Generator,
    kb: Retriever,
    req: RequestConfig | None = None,
    spec: SpecConfig | None = None,
    cache: SpeculativeCache | None = None,
    executor: Executor | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    resume: VerifiedPrefix | None = None,
    on_verified: Callable[[list[int], list, bool], None] | None = None,
) -> RalmResult:
    """Answer ``question`` with RaLMSpec; the tokens equal :func:`ralm.seq.run_seq`'s.

    ``on_commit(tokens)``, if given, is called with tokens once they are verified (they
    can no longer be rolled back), in order; used to stream a response.
    ``on_verified(generated, doc_ids, eos)``, if given, is called with the whole verified
    prefix whenever it grows (to checkpoint it); ``resume`` (a
    :class:`~ralm.results.VerifiedPrefix`) starts from such a prefix.
    """
    req, spec = req or RequestConfig(), spec or SpecConfig()
    run = _SpecRun(question, gen, kb, req, spec, cache, on_commit, resume, on_verified)
    try:
        return run.run(executor or _default_pool())
    finally:
        run.cache.clear()
