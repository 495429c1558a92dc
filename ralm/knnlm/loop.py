"""KNN-LM serving: the baseline (retrieve for every token) and speculative retrieval.

Token choice (both loops, :func:`choose_token`): with the step's float32 logits and the
retrieved neighbours ``(entry, dist)`` ordered by (dist asc, entry id asc),

    p_lm   = softmax(logits) in float64
    p_knn(y) = sum_{j: v_j = y} exp(-dist_j / T) / sum_j exp(-dist_j / T)
    token  = argmax(lambda p_knn + (1 - lambda) p_lm), ties -> lowest token id.

Both loops decode one token at a time with the same incremental KV cache
(:class:`KnnStepper`: one prefill of the prompt, then single-token forwards), so the
hidden state (the query) and the logits at every position are bit-identical.

:func:`run_knn_spec` (RaLMSpec for KNN-LM): each speculative step retrieves the ``k``
nearest entries from the request's cache (:class:`~ralm.knnlm.cache.KnnEntryCache`) and
chooses a token. Every ``s`` steps the ``s`` queries are verified in one batched KB
search; a step is correct when the token chosen with the KB's neighbours equals the
speculated token (the paper's relaxed criterion). At the first mismatch the KV cache is
cropped to that position (``DynamicCache.crop``), the KB's token is taken and decoding
continues from the cropped cache exactly as the baseline would. The KB results of the
committed steps (up to and including the first mismatch; the rest were on a discarded
path) and the ``n`` entries after each go into the cache (with prefetching, P: the KB's
top-p, p > k, of which the top-k is the prefix on the exact index; HNSW is asked for both,
by verifications only). ``s`` is fixed or chosen by OS3
(:class:`ralm.stride.os3.StrideScheduler`: a = speculative step latency, b = verification
latency, fed per batch size, s at most ``KnnLMConfig.max_stride``; s = 0 is a direct KB
step, with the cache's guess recorded on some of them, within a budget:
:meth:`_KnnSpecRun.direct_step`).

Defaults (:class:`~ralm.config.KnnLMConfig`, and PS when no ``spec`` is given): p = 1,024,
n = 20, a cache of 32 KB answers, strides up to 32 (docs/design.md, "KNN-LM defaults").
Every result's ``stats.knn_settings`` records the settings it ran with
(:func:`knn_settings`).

The cycle itself is :func:`ralm.speculation_cycle.speculate`; :class:`_KnnSpecRun` is its
token-level strategy (a step's value is its token).

Exactness: a committed token at position i is always chosen from (logits_i, KB top-k
of h_i); logits_i and h_i are functions of the committed tokens before i computed by
the same sequence of single-token forwards as the baseline; the KB answer of a query
does not depend on its batch (exact re-scoring + boundary expansion), so the tokens
equal :func:`run_knn_seq`'s (the argument in full: :mod:`ralm.speculation_cycle`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ralm import constants as C
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.errors import RalmInputError
from ralm.knnlm.cache import KnnEntryCache, default_capacity
from ralm.knnlm.metric import Hit
from ralm.knnlm.retriever import KnnRetriever
from ralm.knnlm.stepper import stepper_for
from ralm.results import RalmResult, RequestStats
from ralm.seq import finish
from ralm.speculation_cycle import speculate
from ralm.stride.gamma_prior import PROCESS_PRIOR
from ralm.stride.os3 import StrideScheduler
from ralm.stride.shadow_budget import ShadowBudget

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------------------- numerics
def knn_probs(hits: Sequence[Hit], values: np.ndarray, vocab: int, temperature: float) -> np.ndarray:
    """p_knn over the vocabulary from neighbours ordered by (dist asc, id asc)."""
    p = np.zeros(vocab, dtype=np.float64)
    if not hits:
        return p
    ids = np.fromiter((e for e, _ in hits), dtype=np.int64, count=len(hits))
    d = np.fromiter((x for _, x in hits), dtype=np.float64, count=len(hits))
    w = np.exp(-(d - d.min()) / float(temperature))  # shift: same distribution, no underflow
    toks = values[ids].astype(np.int64)
    if toks.max(initial=0) >= vocab:
        raise RalmInputError(f"datastore token id {int(toks.max())} is outside the model's vocabulary ({vocab})")
    np.add.at(p, toks, w)  # sequential, in hit order
    return p / w.sum()


def choose_token(
    p_lm: np.ndarray, hits: Sequence[Hit], values: np.ndarray, knn: KnnLMConfig, mask_token: int | None = None
) -> int:
    """argmax of lambda p_knn + (1 - lambda) p_lm; ties go to the lowest token id."""
    mix = (1.0 - knn.lmbda) * p_lm
    if hits and knn.lmbda > 0:
        mix = mix + knn.lmbda * knn_probs(hits, values, len(p_lm), knn.temperature)
    if mask_token is not None:
        mix = mix.copy()
        mix[mask_token] = -np.inf
    return int(np.argmax(mix))


def _prepare(prompt: str, lm: Any, req: RequestConfig) -> list[int]:
    ids = lm.encode_question(prompt)
    max_pos = getattr(lm, "max_positions", 1 << 30)
    if len(ids) + req.max_new_tokens > max_pos:
        raise RalmInputError(
            f"prompt ({len(ids)}) + {req.max_new_tokens} new tokens exceed the model's {max_pos} positions"
        )
    return ids


def _eos_setup(lm: Any, req: RequestConfig) -> tuple[int | None, int | None]:
    """(eos id that stops generation, token masked out of the argmax)."""
    eos = getattr(lm, "eos_token_id", None)
    if req.ignore_eos:
        return None, eos
    return eos, None


# ---------------------------------------------------------------------------- baseline
def run_knn_seq(
    prompt: str,
    lm: Any,
    kb: KnnRetriever,
    knn: KnnLMConfig | None = None,
    req: RequestConfig | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
) -> RalmResult:
    """KNN-LM baseline: one KB retrieval and one single-token forward per generated token.

    ``lm``: an :class:`~ralm.engine.LMEngine` (model, tokenizer, eos). Defines the right answer.
    """
    knn, req = knn or KnnLMConfig(), req or RequestConfig()
    t_start = time.perf_counter()
    X = _prepare(prompt, lm, req)
    n_q = len(X)
    stop_tok, mask_tok = _eos_setup(lm, req)
    values = kb.ds.values
    st = RequestStats(method="knn-seq", retriever=kb.name, knn_k=knn.k)
    st.knn_settings = knn_settings(kb, knn)
    with stepper_for(lm) as lm_step:  # on exit, the request's KV blocks go back to the engine's pool
        t0 = time.perf_counter()
        lm_step.prefill(X)
        st.gen_time_s += time.perf_counter() - t0
        eos = False
        while len(X) - n_q < req.max_new_tokens:
            h, p_lm = lm_step.query()
            hits = kb.search_vectors([h], knn.k)[0]
            st.kb_calls += 1
            st.kb_queries += 1
            y = choose_token(p_lm, hits, values, knn, mask_tok)
            st.steps += 1
            if stop_tok is not None and y == stop_tok:
                eos = True
                break
            X.append(y)
            if on_commit is not None:
                on_commit([y])
            if len(X) - n_q >= req.max_new_tokens:
                break
            t0 = time.perf_counter()
            lm_step.feed(y)
            st.gen_time_s += time.perf_counter() - t0
    st.forward_passes, st.generated_tokens = lm_step.forwards, len(X) - n_q
    return finish(lm, n_q, X, eos, st, t_start)


# ---------------------------------------------------------------------------- speculation


def default_spec() -> SpecConfig:
    """KNN-LM's default speculation: prefetching and OS3 (PS; KNN-LM has no A)."""
    return SpecConfig.named(C.KNN_DEFAULT_SPEC)


def fetch_size(knn: KnnLMConfig, spec: SpecConfig) -> int:
    """Entries fetched from the KB per query: k, or max(k, p) with prefetching (at most 1024);
    p is ``knn.prefetch_size`` (entries; ``spec.prefetch_size`` counts documents)."""
    return min(max(knn.k, knn.prefetch_size), C.KNN_MAX_K) if spec.prefetch else knn.k


def cache_capacity(kb: KnnRetriever, knn: KnnLMConfig, spec: SpecConfig) -> int:
    """A request's cache capacity: ``knn.cache_max_entries``, or room for
    ``knn.cache_retrievals`` KB answers of :func:`fetch_size` entries with their ``n``
    successors (:func:`~ralm.knnlm.cache.default_capacity`), at most the datastore's size."""
    return knn.cache_max_entries or default_capacity(
        fetch_size(knn, spec), knn.spatial_next, knn.cache_retrievals, entries=len(kb.ds)
    )


def scheduler_spec(knn: KnnLMConfig, spec: SpecConfig) -> SpecConfig:
    """The SpecConfig OS3 runs with for a KNN-LM request: ``spec`` with its stride cap
    replaced by ``knn.max_stride``."""
    return spec.model_copy(update={"max_stride": knn.max_stride}) if spec.adaptive_stride else spec


def knn_settings(kb: KnnRetriever, knn: KnnLMConfig, spec: SpecConfig | None = None) -> dict[str, Any]:
    """The settings a KNN-LM request runs with, as its statistics report them
    (``RequestStats.knn_settings``): the retrieval's, and with ``spec`` the speculation's
    (entries fetched per KB query, ``n``, cache capacity, stride or OS3 and its cap)."""
    out: dict[str, Any] = {"k": knn.k, "lmbda": knn.lmbda, "temperature": knn.temperature, "index": kb.name}
    if spec is None:
        return out
    out.update(
        prefetch=spec.prefetch,
        fetched_per_query=fetch_size(knn, spec),
        spatial_next=knn.spatial_next,
        cache_retrievals=knn.cache_retrievals,
        cache_capacity=cache_capacity(kb, knn, spec),
        adaptive_stride=spec.adaptive_stride,
    )
    if spec.adaptive_stride:
        out.update(max_stride=knn.max_stride, gamma_estimate=spec.gamma_estimate)
    else:
        out.update(stride=spec.stride)
    return out


def new_cache(kb: KnnRetriever, knn: KnnLMConfig, spec: SpecConfig | None = None) -> KnnEntryCache:
    """A request's empty speculative cache of :func:`cache_capacity` entries (``spec``:
    KNN-LM's default, PS, when None)."""
    cap = cache_capacity(kb, knn, spec or default_spec())
    # the projected scan pays off up to k = 256 (a 265K-entry cache: 4.9 vs 19.5 ms at k = 16,
    # 10.8 vs 18.8 at 256); at k = 1024 the bound needs thousands of candidates (23.5 vs 20.3)
    dims = knn.cache_project_dims if knn.k <= C.KNN_PROJECTED_MAX_K else 0
    return KnnEntryCache(kb.ds, knn.spatial_next, cap, knn.rerank_margin, dims)


@dataclass
class _Step:
    query: np.ndarray  # h at the step (float32)
    p_lm: np.ndarray  # LM distribution at the step
    pos: int  # len(X) before the step (= KV length when the query was made)
    token: int  # speculated token (may be EOS)


class _KnnSpecRun:
    """State of one KNN-LM speculative request: the token-level
    :class:`~ralm.speculation_cycle.Strategy` (no async step; a window's truth is the KB's
    top-k of each query, to choose tokens with, and the fetched top-p, to cache)."""

    async_verify = False

    def __init__(
        self,
        prompt: str,
        lm: Any,
        kb: KnnRetriever,
        knn: KnnLMConfig,
        req: RequestConfig,
        spec: SpecConfig,
        cache: KnnEntryCache | None,
        on_commit: Callable[[list[int]], None] | None,
    ):
        if spec.async_verify:
            raise RalmInputError(
                "asynchronous verification (A) is not supported for KNN-LM "
                "(as in the RaLMSpec paper); use a fixed stride or S"
            )
        self.t_start = time.perf_counter()
        self.lm, self.kb, self.knn, self.req, self.spec = lm, kb, knn, req, spec
        self.on_commit = on_commit
        self.X = _prepare(prompt, lm, req)
        self.n_q = len(self.X)
        self.emitted = self.n_q
        self.stop_tok, self.mask_tok = _eos_setup(lm, req)
        self.values = kb.ds.values
        self.eos = False
        # prefetching (P): every KB search fetches the top-p (p >= k) and caches them all;
        # the step's token still uses the top-k, the first k of that list on an exact index
        self.fetch_k = fetch_size(knn, spec)
        self.cache = cache if cache is not None else new_cache(kb, knn, spec)
        sched_spec = scheduler_spec(knn, spec)
        self.sched = StrideScheduler(
            sched_spec,
            prior=PROCESS_PRIOR if spec.gamma_prior else None,
            prior_key=(
                "knn",
                kb.name,
                knn.k,
                self.fetch_k,
                knn.spatial_next,
                self.cache.capacity,
                sched_spec.model_dump_json(),
            ),
        )
        name = ("P," if self.fetch_k > knn.k else "") + (f"s={spec.stride}" if not spec.adaptive_stride else "S")
        self.stats = RequestStats(method=f"knn-spec[{name}]", retriever=kb.name, knn_k=knn.k)
        self.stats.knn_settings = {**knn_settings(kb, knn, spec), "cache_capacity": self.cache.capacity}
        self.step_lm = stepper_for(lm)
        # cache work of direct steps (fills and guesses: see direct_step)
        self.probe_budget = ShadowBudget(("knn", kb.name, len(kb.ds), knn.k, self.fetch_k))
        self._pending_fill: list[list[Hit]] | None = None  # a direct step's KB answer, not yet cached

    @property
    def finished(self) -> bool:
        return self.eos or len(self.X) - self.n_q >= self.req.max_new_tokens

    def remaining_steps(self) -> int:
        return 0 if self.eos else max(0, self.req.max_new_tokens - (len(self.X) - self.n_q))

    # ---- LM
    def _feed(self, token: int) -> float:
        t0 = time.perf_counter()
        self.step_lm.feed(token)
        dt = time.perf_counter() - t0
        self.stats.gen_time_s += dt
        self.sched.record_generation(dt)
        return dt

    def _commit_token(self, y: int) -> None:
        """Append ``y`` (or stop on EOS) and feed it unless the request is finished."""
        if self.stop_tok is not None and y == self.stop_tok:
            self.eos = True
            return
        self.X.append(y)
        if not self.finished:
            self._feed(y)

    def emit(self, pending: _Step | None = None) -> None:
        """Pass the newly committed tokens to ``on_commit`` (no step is ever pending)."""
        if self.on_commit is not None and len(self.X) > self.emitted:
            chunk = self.X[self.emitted :]
            self.emitted = len(self.X)
            self.on_commit(list(chunk))

    def _choose(self, p_lm: np.ndarray, hits: Sequence[Hit]) -> int:
        return choose_token(p_lm, hits, self.values, self.knn, self.mask_tok)

    def _kb_search(
        self, queries: list[np.ndarray], prefetch: bool = True
    ) -> tuple[list[list[Hit]], list[list[Hit]], float]:
        """(top-k of each query, exactly the baseline's answer; what to cache: the top-p
        with prefetching, else the same top-k; search seconds). ``prefetch=False``: only
        the top-k, to cache too (a direct step on HNSW, where the top-p is a second search)."""
        k = self.knn.k
        t0 = time.perf_counter()
        if self.fetch_k == k or (not prefetch and not self.kb.exact):
            truth = fetched = self.kb.search_vectors(queries, k)
        elif self.kb.exact:
            # an exact index ranks every entry by (distance, id): its top-k is the prefix of its top-p
            fetched = self.kb.search_vectors(queries, self.fetch_k)
            truth = [h[:k] for h in fetched]
        else:
            # approximate (HNSW): top-k and top-p are separate searches (a larger search may
            # find other neighbours), so the top-k is asked exactly as the baseline asks it
            truth = self.kb.search_vectors(queries, k)
            fetched = self.kb.search_vectors(queries, self.fetch_k)
        return truth, fetched, time.perf_counter() - t0

    # ---- steps
    def _fill_pending(self) -> float:
        """Insert the last KB answer not yet in the cache; returns the seconds it took."""
        if self._pending_fill is None:
            return 0.0
        t0 = time.perf_counter()
        self.cache.insert_hits(self._pending_fill)
        self._pending_fill = None
        return time.perf_counter() - t0

    def direct_step(self, shadow: bool = True) -> None:
        """One plain KB step (s = 0; ``shadow=False``: the first token).

        A direct step is a RaLMSeq step; anything the cache does in it is overhead the
        baseline does not pay. So a KB answer is not inserted at once: it is kept as the
        *pending fill* and inserted only when the cache is next used, by a speculative step
        or by a *probe*: a direct step on which the cache guesses first (filled with the
        previous step's answer), the guess and the KB latency going to OS3 so that gamma
        stays current. Probes happen only while their cost fits the shadow budget
        (:class:`~ralm.stride.shadow_budget.ShadowBudget`). So on a KB cheaper than the cache (a
        small HNSW index at k = 1024: 5 ms a call, a probe (a fill of 11k entries and a guess)
        about 20 ms: probes average one per 20 / 0.05 = 400 ms of KB time, 80 steps) direct steps cost what
        RaLMSeq's do, and on an expensive KB (a flat one at 225 ms a call) every direct
        step probes.

        On an approximate index (HNSW) a direct step asks only the top-k, as RaLMSeq does:
        the top-p is a second, larger search there, worth paying only in a verification,
        whose window the cache is about to serve. On the exact index the top-p comes from
        the same scan."""
        st = self.stats
        h, p = self.step_lm.query()
        probe = shadow and self.probe_budget.allowed()
        t_guess = 0.0
        guess = None
        if probe:
            t_fill = self._fill_pending()
            t0 = time.perf_counter()
            guess = self._choose(p, self.cache.search(h, self.knn.k))
            t_guess = time.perf_counter() - t0
            st.cache_lookups += 1
            self.probe_budget.spend(t_fill + t_guess)
        truth, fetched, b = self._kb_search([h], prefetch=False)
        self._pending_fill = fetched
        self.probe_budget.add_kb_time(b)
        y = self._choose(p, truth[0])
        if probe:
            st.shadow_hits += int(guess == y)
        if shadow:
            # every direct step's KB latency; gamma evidence only from a probe's guess
            self.sched.record_direct(guess == y if probe else None, b + t_guess)
        else:
            self.sched.record_kb_latency(1, b)  # b(1) before the first decision
        self._commit_token(y)

    def first_step(self) -> None:
        self.direct_step(shadow=False)  # its answer fills the cache when the cache is first used

    def speculative_step(self) -> _Step:
        t0 = time.perf_counter()
        self._fill_pending()  # the last direct step's answer (counted in this step's latency)
        h, p = self.step_lm.query()
        hits = self.cache.search(h, self.knn.k)
        self.stats.cache_lookups += 1
        y = self._choose(p, hits)
        step = _Step(h, p, len(self.X), y)
        self._commit_token(y)
        self.stats.spec_steps += 1
        self.sched.record_step(time.perf_counter() - t0)
        return step

    # ---- verification (a step is right when the KB's neighbours choose the same token)
    def verify(self, window: Sequence[_Step]) -> tuple[tuple[list[list[Hit]], list[list[Hit]]], float]:
        truth, fetched, b = self._kb_search([w.query for w in window])
        return (truth, fetched), b

    def first_mismatch(self, window: Sequence[_Step], truth) -> tuple[int, int] | None:
        for i, (w, t) in enumerate(zip(window, truth[0])):
            y = self._choose(w.p_lm, t)
            if y != w.token:
                return i, y
        return None

    def cache_truth(self, truth, upto: int) -> None:
        # cache the KB answers of the committed trajectory only (the steps up to and
        # including the first mismatch), newest last: the steps after a mismatch were on
        # a path that is thrown away, and their entries would evict the useful ones
        self.cache.insert_hits(truth[1][:upto])

    def accept(self, steps: Sequence[_Step]) -> None:
        pass  # the tokens are already in X

    def rollback(self, step: _Step) -> int:
        dropped = len(self.X) - step.pos
        del self.X[step.pos :]
        self.eos = False
        self.step_lm.crop(step.pos)  # KV of X[:pos], as when the query was made
        return dropped

    def commit_correction(self, token: int) -> None:
        self._commit_token(token)  # the KB's token, fed on the cropped cache

    def run(self) -> RalmResult:
        st = self.stats
        t0 = time.perf_counter()
        with self.step_lm:  # on exit, the request's KV blocks go back to the engine's pool
            self.step_lm.prefill(self.X)
            st.gen_time_s += time.perf_counter() - t0
            speculate(self, self.sched, st)
        st.cache_entries = len(self.cache)
        st.forward_passes = self.step_lm.forwards
        st.generated_tokens = len(self.X) - self.n_q + st.regenerated_tokens  # rolled-back tokens included
        return finish(self.lm, self.n_q, self.X, self.eos, st, self.t_start)


def run_knn_spec(
    prompt: str,
    lm: Any,
    kb: KnnRetriever,
    knn: KnnLMConfig | None = None,
    req: RequestConfig | None = None,
    spec: SpecConfig | None = None,
    cache: KnnEntryCache | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
) -> RalmResult:
    """KNN-LM with speculative retrieval; the tokens equal :func:`run_knn_seq`'s.

    ``spec``: stride (fixed) or ``adaptive_stride`` (OS3, strides up to ``knn.max_stride``);
    ``prefetch`` (P) makes every KB search fetch the top-``knn.prefetch_size`` (when larger
    than k) and cache them all with their successors, while tokens still use the top-k;
    async is rejected. None: PS (:func:`default_spec`). ``on_commit(tokens)`` receives
    tokens once verified. ``result.stats.knn_settings`` lists the settings used.
    """
    knn, req, spec = knn or KnnLMConfig(), req or RequestConfig(), spec or default_spec()
    run = _KnnSpecRun(prompt, lm, kb, knn, req, spec, cache, on_commit)
    return run.run()
