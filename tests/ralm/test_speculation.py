"""The generic speculation cycle (:func:`ralm.speculation_cycle.speculate`) driven by a fake
strategy: pure Python, no model, no KB.

A step appends one token. The KB's value for a state is a function of the whole prefix
(``kb_value``), so a step speculated after a wrong guess runs on a wrong state and gets a
different KB answer, as in the real loops. The cache guesses the KB's value except at the
positions listed in ``wrong`` (the first time those positions are speculated).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from ralm.results import RequestStats
from ralm.speculation_cycle import speculate


def kb_value(prefix: tuple[int, ...]) -> int:
    return (sum(prefix) * 31 + len(prefix)) % 1000


def baseline(n: int) -> list[int]:
    X: list[int] = []
    while len(X) < n:
        X.append(kb_value(tuple(X)))
    return X


@dataclass
class FakeStep:
    pos: int
    prefix: tuple[int, ...]
    guess: int


class FakeScheduler:
    def __init__(self, strides: list[int]):
        self.strides = list(strides)
        self.recorded: list[tuple[int, int, float]] = []
        self.realized: list[tuple[bool, int]] = []  # (direct step?, steps committed)
        self.gamma = 0.25
        self.finished = False
        self.positions: list[int | None] = []  # the position each decision was told
        self.remaining: list[int | None] = []  # ... and the steps left

    def next_stride(self, position: int | None = None, remaining: int | None = None) -> int:
        self.positions.append(position)
        self.remaining.append(remaining)
        return self.strides.pop(0) if len(self.strides) > 1 else self.strides[0]

    def record_verification(self, s: int, matched: int, latency_s: float, overlapped: bool = False) -> None:
        self.recorded.append((s, matched, latency_s))

    def record_realized(self, direct: bool, seconds: float, committed: int) -> None:
        self.realized.append((direct, committed))
        assert seconds >= 0

    def finish(self) -> None:
        self.finished = True


class InlineExecutor:
    """Runs a submitted call at once (the window's states are captured in its steps)."""

    def submit(self, fn, *args):
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


class FakeStrategy:
    def __init__(self, n: int, wrong=(), async_verify: bool = False):
        self.n = n
        self.wrong = set(wrong)
        self.async_verify = async_verify
        self.X: list[int] = []
        self.emitted: list[int] = []
        self.windows: list[list[int]] = []  # positions of each verified window
        self.accepted: list[int] = []
        self.rolled_back: list[int] = []
        self.corrections: list[int] = []
        self.cached: list[tuple[int, int]] = []  # (answers in the window, upto)
        self.speculated: list[int] = []

    @property
    def finished(self) -> bool:
        return len(self.X) >= self.n

    def remaining_steps(self) -> int:
        return self.n - len(self.X)

    def first_step(self) -> None:
        assert not self.finished, "a step after the end"
        self.X.append(kb_value(tuple(self.X)))

    def direct_step(self) -> None:
        assert not self.finished, "a step after the end"
        self.X.append(kb_value(tuple(self.X)))

    def speculative_step(self) -> FakeStep:
        assert not self.finished, "a step after the end"
        pos, prefix = len(self.X), tuple(self.X)
        guess = kb_value(prefix)
        if pos in self.wrong:
            self.wrong.discard(pos)
            guess += 1
        self.speculated.append(pos)
        self.X.append(guess)
        return FakeStep(pos, prefix, guess)

    def verify(self, window):
        self.windows.append([w.pos for w in window])
        return [kb_value(w.prefix) for w in window], 0.5

    def first_mismatch(self, window, truth):
        for i, (w, t) in enumerate(zip(window, truth)):
            if w.guess != t:
                return i, t
        return None

    def cache_truth(self, truth, upto: int) -> None:
        self.cached.append((len(truth), upto))

    def accept(self, steps) -> None:
        self.accepted.extend(w.pos for w in steps)

    def rollback(self, step: FakeStep) -> int:
        self.rolled_back.append(step.pos)
        dropped = len(self.X) - step.pos
        del self.X[step.pos :]
        return dropped

    def commit_correction(self, value: int) -> None:
        self.corrections.append(value)
        self.X.append(value)

    def emit(self, pending) -> None:
        upto = pending.pos if pending is not None else len(self.X)
        self.emitted.extend(self.X[len(self.emitted) : upto])


def run(strategy: FakeStrategy, strides: list[int]) -> tuple[RequestStats, FakeScheduler]:
    sched, st = FakeScheduler(strides), RequestStats()
    speculate(strategy, sched, st, InlineExecutor())
    return st, sched


@pytest.mark.parametrize("m", [0, 1, 2, 3])
def test_mismatch_at_step_m_keeps_the_steps_before_it(m):
    # step 0 is the first (KB) step; the first window is steps 1..4, wrong at step 1 + m
    n = 5
    fs = FakeStrategy(n, wrong={1 + m})
    st, sched = run(fs, [4])
    assert fs.X == fs.emitted == baseline(n)
    assert fs.windows[0] == [1, 2, 3, 4]
    # exactly the steps before m, then the next window's (step 1 + m is the correction)
    assert fs.accepted == list(range(1, 1 + m)) + list(range(2 + m, n))
    assert fs.rolled_back == [1 + m]
    assert fs.corrections == [baseline(n)[1 + m]]  # the KB's value on the right state
    assert sched.finished  # told the request ended (its evidence joins the prior)
    assert fs.cached[0] == (4, m + 1)  # committed trajectory: up to m
    assert sched.recorded[0] == (4, m, 0.5)
    rest = 3 - m  # steps after the correction
    assert st.rollbacks == 1 and st.regenerated_tokens == 4 - m
    assert st.steps == n and st.matched_steps == m + rest
    assert st.verifications == 1 + (rest > 0) and st.strides == [4] + ([rest] if rest else [])
    assert st.kb_calls == 1 + st.verifications and st.kb_queries == 1 + 4 + rest
    assert st.gamma == 0.25


def test_no_mismatch_keeps_the_whole_window():
    fs = FakeStrategy(7)
    st, sched = run(fs, [3])
    assert fs.X == baseline(7) and fs.windows == [[1, 2, 3], [4, 5, 6]]
    assert fs.accepted == [1, 2, 3, 4, 5, 6] and not fs.rolled_back
    assert fs.cached == [(3, 3), (3, 3)]
    assert (st.steps, st.matched_steps, st.rollbacks, st.regenerated_tokens) == (7, 6, 0, 0)
    assert (st.kb_calls, st.kb_queries, st.verifications, st.strides) == (3, 7, 2, [3, 3])


def test_async_extra_step_kept_on_a_full_match():
    fs = FakeStrategy(6, async_verify=True)
    st, sched = run(fs, [2])
    assert fs.X == fs.emitted == baseline(6)
    # window [1, 2] runs step 3 while verified; step 3 then opens the next window
    assert fs.windows[:2] == [[1, 2], [3, 4]]
    assert st.async_steps_kept >= 1 and st.async_steps_discarded == 0
    assert st.kb_queries == 1 + sum(st.strides) and st.steps == 6 and st.rollbacks == 0


def test_async_extra_step_discarded_on_a_mismatch():
    fs = FakeStrategy(6, wrong={2}, async_verify=True)
    emitted_after: list[list[int]] = []
    orig_emit = fs.emit

    def emit(pending):
        orig_emit(pending)
        emitted_after.append(list(fs.emitted))

    fs.emit = emit
    st, sched = run(fs, [2])
    assert fs.X == fs.emitted == baseline(6)
    assert fs.windows[0] == [1, 2]
    # steps 2 and the extra step 3 are thrown away; step 2 is corrected, 3 speculated again
    assert fs.rolled_back == [2] and fs.speculated[:3] == [1, 2, 3]
    assert fs.windows[1][0] == 3 and st.async_steps_discarded == 1
    assert st.regenerated_tokens == 2
    assert emitted_after[1] == baseline(6)[:3]  # steps 0, 1 and the correction
    assert sched.recorded[0] == (2, 1, 0.5)


def test_pending_step_is_not_emitted_before_it_is_verified():
    fs = FakeStrategy(4, async_verify=True)
    seen: list[tuple[int, int]] = []
    orig_emit = fs.emit

    def emit(pending):
        orig_emit(pending)
        seen.append((len(fs.emitted), len(fs.X)))

    fs.emit = emit
    run(fs, [2])
    # after the first window [1, 2] the async step 3 is in X but not emitted
    assert seen[1] == (3, 4)
    assert fs.emitted == baseline(4)


def test_direct_steps_are_counted():
    fs = FakeStrategy(4)
    st, sched = run(fs, [0])
    assert fs.X == fs.emitted == baseline(4) and not fs.windows
    assert (st.steps, st.direct_steps, st.kb_calls, st.kb_queries, st.verifications) == (4, 3, 4, 4, 0)
    assert st.gamma == 0.25


def test_async_needs_an_executor():
    fs = FakeStrategy(4, async_verify=True)
    with pytest.raises(ValueError):
        speculate(fs, FakeScheduler([2]), RequestStats(), None)


def test_a_pending_step_is_verified_before_any_direct_step():
    # s = 0 while an async step is pending: the pending step is verified as a window of
    # its own, with no new async step meanwhile, and the direct steps follow. (Running one
    # would chain: each matching async step would open another window, and a direct step
    # chosen by the scheduler or the rate check would never happen; measured on BM25 over
    # 1M passages, PSA ran 0.90x RaLMSeq that way.)
    fs = FakeStrategy(6, async_verify=True)
    st, sched = run(fs, [2, 0])
    assert fs.X == fs.emitted == baseline(6)
    assert fs.windows == [[1, 2], [3]]
    assert st.direct_steps == 2 and st.async_steps_kept == 1 and st.strides == [2, 1]


def test_the_scheduler_hears_what_each_window_and_direct_step_committed():
    """For the rate check: a window reports the steps it committed (its matched steps, plus
    the correction after a mismatch); a direct step reports one. For the positional gamma:
    each decision is told the steps committed before it."""
    fs = FakeStrategy(9, wrong={3})
    st, sched = run(fs, [2, 2, 0, 0, 3])
    assert fs.X == baseline(9)
    # windows [1, 2] (both right), [3, 4] (3 wrong: the correction), then direct 4 and 5,
    # then [6, 7, 8]
    assert sched.realized == [(False, 2), (False, 1), (True, 1), (True, 1), (False, 3)]
    assert sum(c for _, c in sched.realized) + 1 == st.steps  # + the first step
    assert sched.positions == [1, 3, 4, 5, 6]  # after step 0, then what each window or direct step committed
    assert sched.remaining == [9 - p for p in sched.positions]


class HintedStrategy(FakeStrategy):
    """Records, in order, the windows opened (``window_opens``) and the steps taken."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list[str] = []

    def window_opens(self) -> None:
        self.events.append("open")

    def direct_step(self) -> None:
        self.events.append("direct")
        super().direct_step()

    def speculative_step(self) -> FakeStep:
        self.events.append("spec")
        return super().speculative_step()

    def verify(self, window):
        self.events.append("verify")
        return super().verify(window)


def test_a_strategy_is_told_before_each_window_runs_speculative_steps():
    """``window_opens`` (the shared KB's batching hint) comes before each window's first
    speculative step, never before a direct step, and not for a window that only verifies
    a pending async step (it makes its KB call at once)."""
    fs = HintedStrategy(8)
    run(fs, [2, 0, 3])
    assert fs.X == baseline(8)
    # step 0 (KB), window [1, 2], direct 3, window [4, 5, 6], window [7]
    assert fs.events == ["open", "spec", "spec", "verify", "direct"] + ["open"] + ["spec"] * 3 + [
        "verify",
        "open",
        "spec",
        "verify",
    ]

    pending = HintedStrategy(6, async_verify=True)
    run(pending, [2, 0])
    assert pending.X == baseline(6)
    # window [1, 2] with async step 3; s = 0: step 3 verified alone (no hint), then direct steps
    assert pending.events == ["open", "spec", "spec", "verify", "spec", "verify", "direct", "direct"]
    # a strategy without the hook runs as before
    plain = FakeStrategy(8)
    run(plain, [2, 0, 3])
    assert plain.X == baseline(8)


class OverlapCheckingScheduler(FakeScheduler):
    """A scheduler with OS3's overlap check: lets the windows overlap while ``verdicts``
    says so, and keeps what each overlapped window measured."""

    def __init__(self, strides: list[int], verdicts: list[bool]):
        super().__init__(strides)
        self.verdicts = list(verdicts)
        self.overlaps: list[tuple[float, int, float | None]] = []
        self.overlapped: list[bool] = []

    def async_pays(self) -> bool:
        return self.verdicts.pop(0)

    def record_overlap(self, phase_s: float, s: int, step_s: float | None) -> None:
        self.overlaps.append((phase_s, s, step_s))

    def record_verification(self, s: int, matched: int, latency_s: float, overlapped: bool = False) -> None:
        super().record_verification(s, matched, latency_s)
        self.overlapped.append(overlapped)


def test_windows_run_synchronously_where_the_scheduler_says_overlap_does_not_pay():
    fs = FakeStrategy(11, async_verify=True)
    sched = OverlapCheckingScheduler([2], verdicts=[True, False, False, True, True, True])
    st = RequestStats()
    speculate(fs, sched, st, InlineExecutor())
    assert fs.X == fs.emitted == baseline(11)
    # window 1 overlaps (its extra step 3 opens window 2); windows 2 and 3 are verified alone
    # (no extra step); window 4 overlaps again
    assert fs.windows[:4] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert sched.overlapped[:4] == [True, False, False, True]
    assert st.async_windows_declined == 2 and st.async_steps_kept >= 1
    # each overlapped window reports its phase, its size and one of its own steps' time
    # (window 1 ran 2 steps of its own; window 4 ran 2 as well)
    assert [(s, step is not None) for _, s, step in sched.overlaps][:2] == [(2, True), (2, True)]
    assert all(phase >= 0 for phase, _, _ in sched.overlaps)
