"""The shadow budget (ralm/stride/shadow_budget.py) and the document-level direct steps that use it
(``ralm.spec._SpecRun.direct_step``): a probe (the cache's guess on a direct step) runs
only while the lookups stay within ``SHADOW_BUDGET`` of the direct steps' KB time.

The stride is forced to 0 by patching the scheduler's decision, and the KB or the cache is
slowed by a fixed sleep, so the budget's outcome does not depend on this machine's speed.
Every run's tokens are compared with RaLMSeq's. Real KBs: the fixture's BM25 (Lucene) and
exact dense indexes."""

from __future__ import annotations

import time

import pytest

from cache.speculative import SpeculativeCache
from ralm import constants as C
from ralm.config import RequestConfig, SpecConfig
from ralm.seq import run_seq
from ralm.spec import run_spec
from ralm.stride.os3 import StrideScheduler
from ralm.stride.shadow_budget import LAST_PROBE_COST, ShadowBudget

REQ = RequestConfig(max_new_tokens=40, generation_stride=4, ignore_eos=True)  # 10 steps
STEPS = 10
SPEC = SpecConfig(adaptive_stride=True, gamma_prior=False)


def test_the_worked_example():
    """Share 0.05, a probe of 0.4 ms, a KB call of 2 ms: the first probe is free (its cost
    is unknown), then probes average one per 0.4 / 0.05 = 8 ms of KB time."""
    budget = ShadowBudget("worked-example", share=0.05)
    probes = []
    for step in range(40):
        if budget.allowed():
            probes.append(step)
            budget.spend(0.4e-3)
        budget.add_kb_time(2e-3)
    assert probes[0] == 0
    assert probes == [0, 8, 12, 16, 20, 24, 28, 32, 36]
    assert budget.probe_s <= 0.05 * budget.kb_s + 0.4e-3
    # a new request on the same KB starts from the last probe's cost: no free probe
    assert LAST_PROBE_COST["worked-example"] == 0.4e-3
    assert not ShadowBudget("worked-example", share=0.05).allowed()
    assert ShadowBudget("another KB", share=0.05).allowed()


@pytest.fixture
def always_direct(monkeypatch):
    monkeypatch.setattr(StrideScheduler, "next_stride", lambda self, position=None, remaining=None: 0)


def _slowed(fn, seconds: float, calls: list | None = None):
    def slow(*args, **kwargs):
        if calls is not None:
            calls.append(1)
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def _heard(monkeypatch) -> list:
    """What OS3 hears from each direct step: the guess was right, wrong, or None (no probe)."""
    heard: list = []
    real = StrideScheduler.record_direct

    def record(self, right, b, lookup=None):
        heard.append(right)
        return real(self, right, b, lookup)

    monkeypatch.setattr(StrideScheduler, "record_direct", record)
    return heard


def test_a_cache_dearer_than_the_kb_is_probed_once_then_left_alone(
    fixture_generator, retrievers, fixture_questions, monkeypatch, always_direct
):
    """A lookup costs 10 ms, a BM25 query on the fixture about a millisecond: the first
    direct step probes, and the budget (5% of the KB time) never affords another; a second
    request on the same KB knows the cost and does no lookup at all."""
    kb = retrievers["sr"]
    heard = _heard(monkeypatch)
    for i, question in enumerate(fixture_questions[:2]):
        base = run_seq(question, fixture_generator, kb, REQ)
        cache = SpeculativeCache(kb.scorer)
        lookups: list = []
        monkeypatch.setattr(cache, "search", _slowed(cache.search, 0.010, lookups))
        heard.clear()
        got = run_spec(question, fixture_generator, kb, REQ, SPEC, cache=cache)
        assert got.tokens == base.tokens
        st = got.stats
        assert st.direct_steps == STEPS - 1 == len(heard)
        assert len(lookups) == st.cache_lookups == (1 if i == 0 else 0)
        assert sum(r is not None for r in heard) == len(lookups)


@pytest.mark.parametrize("kind", ["sr", "edr"])
def test_an_expensive_kb_affords_a_probe_on_every_step(
    kind, fixture_generator, retrievers, fixture_questions, monkeypatch, always_direct
):
    """A KB call costs 60 ms (5% of it: 3 ms, far above a lookup in a small cache): the
    cache guesses on every direct step and OS3 hears each guess."""
    kb = retrievers[kind]
    question = fixture_questions[2]
    base = run_seq(question, fixture_generator, kb, REQ)
    monkeypatch.setattr(kb, "search", _slowed(kb.search, 0.060))
    heard = _heard(monkeypatch)
    got = run_spec(question, fixture_generator, kb, REQ, SPEC)
    assert got.tokens == base.tokens
    st = got.stats
    assert st.direct_steps == STEPS - 1 == len(heard)
    probes = [r for r in heard if r is not None]
    assert len(probes) == st.cache_lookups == STEPS - 1
    assert sum(probes) == st.shadow_hits
    assert st.gamma is not None


def test_the_lookups_stay_within_the_share_of_the_kb_time(
    fixture_generator, retrievers, fixture_questions, monkeypatch, always_direct
):
    """Timed from outside: the cache's lookups in direct steps stay within the budget plus
    one probe (the probe allowed last may overshoot by its own cost)."""
    kb = retrievers["sr"]
    question = fixture_questions[3]
    base = run_seq(question, fixture_generator, kb, REQ.model_copy(update={"max_new_tokens": 120}))
    cache = SpeculativeCache(kb.scorer)
    spent = {"cache": 0.0, "kb": 0.0}

    def timed(fn, key, sleep):
        def run(*a, **kw):
            t0 = time.perf_counter()
            time.sleep(sleep)
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0

        return run

    monkeypatch.setattr(cache, "search", timed(cache.search, "cache", 0.002))
    monkeypatch.setattr(kb, "search", timed(kb.search, "kb", 0.004))
    got = run_spec(question, fixture_generator, kb, REQ.model_copy(update={"max_new_tokens": 120}), SPEC, cache=cache)
    assert got.tokens == base.tokens
    assert 2 <= got.stats.cache_lookups < got.stats.direct_steps  # ~120 ms of KB time: some probes, not all
    assert spent["cache"] <= C.SHADOW_BUDGET * spent["kb"] + 0.002 + 0.003  # one probe and some slack
