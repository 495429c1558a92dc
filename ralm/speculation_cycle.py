"""The speculation cycle shared by document-level RaLMSpec and token-level KNN-LM.

Both are the same loop (RaLMSpec paper, Algorithm 1); only what a *step* is differs, and
that is a :class:`Strategy`: a step of :mod:`ralm.spec` is ``f(doc, X, k)`` on a cached
document, a step of :mod:`ralm.knnlm.loop` is one token chosen with cached neighbours.
:func:`speculate` drives the cycle:

    first step (the KB's own answer; it warms the cache)
    repeat until finished:
        s = scheduler.next_stride()
        s == 0 -> one direct step (KB answer, no speculation); an async step still
                  pending is first verified on its own, with no new async step
        else   -> up to s speculative steps (the window), one batched KB verification
                  (with the strategy's async extra step running meanwhile, if it allows one),
                  first mismatch m, cache the KB's answers, keep steps < m,
                  roll back to step m and commit the KB's value for it (the correction),
                  tell the scheduler (s, matched, latency), emit what is now verified

Exactness (why the committed tokens equal the baseline's, for any strategy)
-------------------------------------------------------------------------
Write the baseline as a state ``X_0`` (the prompt) and, for each step ``i``,
``r_i = KB(q(X_i))`` and ``X_{i+1} = X_i + f(v(r_i), X_i)``, where ``v`` is the *value* a
step consumes (the document ids it uses; for KNN-LM the token chosen from ``(logits_i,
r_i)``) and ``f`` is deterministic. A speculative step computes the same thing with the
cache's answer ``r^_i`` in place of ``r_i``. Two facts make speculation exact:

1. the KB's answer to a query does not depend on the batch it is sent in (exact
   re-scoring with boundary expansion, :func:`ralm.retrieval.rerank.exact_top_k`), and
2. a step's successor state depends on its retrieval only through ``v``.

Invariant: at the top of each loop iteration, every *committed* step (all steps except a
pending async one) used the KB's value for a state equal to the baseline's, so the
committed prefix equals the baseline's ``X_c``. Direct and first steps use the KB's
answer itself, which keeps the invariant. A window starts from ``X_c``; by induction on
``j``, while the speculated values equal the KB's (``v(r^_j) == v(KB(q(X^_j)))``),
``X^_j = X_j`` and so the KB's answer is the baseline's ``r_j``. At the first mismatch
``m`` the state ``X^_m`` still equals ``X_m``, so the verification's answer for it *is*
``r_m``: rolling back to ``X_m`` and committing ``f(v(r_m), X_m)`` produces ``X_{m+1}``.
Everything speculated after ``m`` (and an async extra step) ran on a wrong state and is
thrown away. The cache only decides which guesses are made (speed), never what is
committed; a speculated EOS or length limit ends a window early but is itself verified.

Worked example. The committed prefix is ``X_4``; the scheduler says ``s = 4``, so steps
4, 5, 6, 7 are speculated with values ``a, b, c, d``; with async verification an extra
step 8 runs while the KB answers. The KB's values are ``a, b, z, *``: the first mismatch
is at ``m = 2`` (step 6). Steps 4 and 5 are kept (``matched_steps += 2, steps += 2``);
the state is rolled back to the mark of step 6, discarding the tokens of steps 6, 7 and 8
(``regenerated_tokens`` counts them; the extra step counts as ``async_steps_discarded``);
step 6 is committed with ``z`` (``steps += 1``, ``rollbacks += 1``), which is exactly the
baseline's step 6. The scheduler records ``(s=4, matched=2)``. Had all four matched,
steps 4..7 would be kept and step 8 would become the first step of the next window
(``async_steps_kept``), still to be verified there; nothing after step 7 is emitted
until then.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from ralm.results import RequestStats
from ralm.stride.os3 import StrideScheduler

StepT = TypeVar("StepT")
TruthT = TypeVar("TruthT")


class Strategy(Protocol[StepT, TruthT]):
    """What one step speculates, and how it is checked and undone.

    ``StepT`` is the record of a speculative step (its query, its guess, the state mark to
    roll back to); ``TruthT`` is a verification's answer for a window, in whatever form
    the strategy needs (e.g. the hits to use and the hits to cache).
    """

    async_verify: bool
    """May run one speculative step while a verification is in flight."""

    @property
    def finished(self) -> bool:
        """EOS or the length limit reached (by the committed *or* speculated steps)."""

    def remaining_steps(self) -> int:
        """The most steps the request can still take after those run so far (committed or
        speculated); EOS may end it sooner."""

    def first_step(self) -> None:
        """Step 0 on the KB's answer (one KB query); warms the cache."""

    def direct_step(self) -> None:
        """s = 0: one step on the KB's answer (one KB query), no speculation."""

    def speculative_step(self) -> StepT:
        """One step on the cache's answer; returns its record."""

    def verify(self, window: Sequence[StepT]) -> tuple[TruthT, float]:
        """The KB's answers for the window's queries (one batched call) and its seconds.
        May run in a worker thread while :meth:`speculative_step` runs."""

    def first_mismatch(self, window: Sequence[StepT], truth: TruthT) -> tuple[int, Any] | None:
        """``(m, the KB's value for step m)`` for the first step whose guess was wrong, or None."""

    def cache_truth(self, truth: TruthT, upto: int) -> None:
        """Insert the verification's answers into the cache; ``upto`` is the number of
        window steps on the committed trajectory (all, or up to and including m)."""

    def accept(self, steps: Sequence[StepT]) -> None:
        """``steps`` (a prefix of the window) are verified: record them as committed."""

    def rollback(self, step: StepT) -> int:
        """Undo ``step`` and everything after it; returns the number of tokens discarded."""

    def commit_correction(self, value: Any) -> None:
        """Run the rolled-back step again with the KB's value."""

    def emit(self, pending: StepT | None) -> None:
        """Pass on the newly verified output (everything before ``pending``, if any)."""

    # Optional, looked up with getattr: ``window_opens()`` is called when a window is about to
    # run speculative steps (no KB call until its verification); a strategy whose KB batches
    # several requests' calls passes it on (:class:`~ralm.retrieval.base.SharedKB`).


def _count_kb_step(stats: RequestStats) -> None:
    """A step on the KB's own answer: one KB call of one query, one committed step."""
    stats.kb_calls += 1
    stats.kb_queries += 1
    stats.steps += 1


def speculate(
    strategy: Strategy[StepT, TruthT],
    sched: StrideScheduler,
    stats: RequestStats,
    executor: Executor | None = None,
) -> None:
    """Run the speculation cycle until ``strategy.finished`` (see the module docstring).

    ``sched`` chooses each window's stride and is told every verification's outcome;
    ``stats`` receives the loop's counts (KB calls and queries, verifications, strides,
    matched and committed steps, rollbacks, regenerated tokens, async steps, gamma).
    ``executor`` runs verifications while the async extra step runs (needed only when
    ``strategy.async_verify``).
    """
    st = stats
    # optional: a strategy whose KB is shared with other requests is told when a window opens
    window_opens = getattr(strategy, "window_opens", None)
    # optional: a scheduler that checks whether overlapping pays here (OS3's overlap check)
    async_pays = getattr(sched, "async_pays", None)
    record_overlap = getattr(sched, "record_overlap", None)
    if not strategy.finished:  # (a resumed request may already be complete)
        strategy.first_step()
        _count_kb_step(st)
        strategy.emit(None)
    pending: StepT | None = None  # an async step waiting to open the next window
    while not strategy.finished or pending is not None:
        t_start = time.perf_counter()
        # a pending async step is the next window's first: it counts among the steps left
        s = sched.next_stride(position=st.steps, remaining=strategy.remaining_steps() + (pending is not None))
        if s == 0 and pending is None:
            strategy.direct_step()
            _count_kb_step(st)
            st.direct_steps += 1
            strategy.emit(None)
            sched.record_realized(True, time.perf_counter() - t_start, 1)
            continue
        window: list[StepT] = [pending] if pending is not None else []
        pending = None
        if window_opens is not None and len(window) < s and not strategy.finished:
            window_opens()  # no KB call until this window's verification (a batching hint)
        carried, t_steps = len(window), time.perf_counter()
        while len(window) < s and not strategy.finished:
            window.append(strategy.speculative_step())
        fresh = len(window) - carried  # this window's own steps, none of them overlapped
        step_s = (time.perf_counter() - t_steps) / fresh if fresh else None
        extra: StepT | None = None
        # s == 0 with a step pending: verify it alone and start no new async step, or a run
        # of matching async steps would never let a direct step (the scheduler's or the
        # rate check's choice) happen
        overlapped = strategy.async_verify and s > 0 and not strategy.finished
        if overlapped and async_pays is not None and not async_pays():
            overlapped = False  # measured: overlapping saves nothing here
            st.async_windows_declined += 1
        if overlapped:
            if executor is None:
                raise ValueError("asynchronous verification needs an executor")
            t_phase = time.perf_counter()
            fut = executor.submit(strategy.verify, window)
            extra = strategy.speculative_step()  # overlaps with the verification
            truth, b = fut.result()
            if record_overlap is not None:
                record_overlap(time.perf_counter() - t_phase, len(window), step_s)
        else:
            truth, b = strategy.verify(window)
        st.kb_calls += 1
        st.kb_queries += len(window)
        st.verifications += 1
        st.strides.append(len(window))
        found = strategy.first_mismatch(window, truth)
        matched = len(window) if found is None else found[0]
        strategy.cache_truth(truth, len(window) if found is None else matched + 1)
        st.matched_steps += matched
        st.steps += matched
        strategy.accept(window[:matched])
        if found is None:
            if extra is not None:
                pending = extra  # verified next window, first
                st.async_steps_kept += 1
        else:
            st.rollbacks += 1
            if extra is not None:
                st.async_steps_discarded += 1  # it ran after the mismatch
            st.regenerated_tokens += strategy.rollback(window[matched])
            strategy.commit_correction(found[1])  # the baseline's step m
            st.steps += 1
        sched.record_verification(len(window), matched, b, overlapped=overlapped)
        strategy.emit(pending)
        sched.record_realized(False, time.perf_counter() - t_start, matched + (found is not None))
    st.gamma = sched.gamma
    sched.finish()
