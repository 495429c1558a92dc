"""Direct (s = 0) steps of KNN-LM speculation: the cache's shadow work (fills and probes)
stays within its budget of the KB time (ralm/knnlm/loop.py, ``_KnnSpecRun.direct_step``; ralm/stride/shadow_budget.py).

The stride is forced to 0 by patching the scheduler's decision, and the KB or the cache is
slowed by a fixed sleep, so the budget's outcome does not depend on this machine's speed.
Every run's tokens are still compared with the baseline's."""

from __future__ import annotations

import time

import pytest

from ralm import constants as C
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.knnlm import run_knn_seq, run_knn_spec
from ralm.knnlm.loop import new_cache
from ralm.stride import shadow_budget
from ralm.stride.os3 import StrideScheduler
from ralm.stride.shadow_budget import ShadowBudget

MAX_NEW = 24
KNN = KnnLMConfig(k=16, lmbda=0.5, index="hnsw")
REQ = RequestConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
SPEC = SpecConfig(adaptive_stride=True, gamma_prior=False)


@pytest.fixture
def always_direct(monkeypatch):
    monkeypatch.setattr(StrideScheduler, "next_stride", lambda self, position=None, remaining=None: 0)
    monkeypatch.setattr(shadow_budget, "LAST_PROBE_COST", {})  # no probe cost known from earlier tests


def _slowed(fn, seconds: float, calls: list | None = None):
    def slow(*args, **kwargs):
        if calls is not None:
            calls.append(1)
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def _dear_cache(kb, monkeypatch, fills: list):
    cache = new_cache(kb, KNN, SPEC)
    monkeypatch.setattr(cache, "insert_hits", _slowed(cache.insert_hits, 0.010, fills))
    return cache


def test_a_cache_dearer_than_the_kb_is_probed_once_then_left_alone(knn_setups, knn_prompts, monkeypatch, always_direct):
    """A fill costs 10 ms, a KB call well under a millisecond: the first direct step probes
    (no cost known yet), and then the budget (5% of the KB time) never affords another;
    a second request on the same KB knows the cost and does no cache work at all."""
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["hnsw"]
    for i, prompt in enumerate(knn_prompts[:2]):
        base = run_knn_seq(prompt, lm, kb, KNN, REQ)
        fills: list = []
        got = run_knn_spec(prompt, lm, kb, KNN, REQ, SPEC, cache=_dear_cache(kb, monkeypatch, fills))
        assert got.tokens == base.tokens
        st = got.stats
        assert st.direct_steps == MAX_NEW - 1
        assert len(fills) == st.cache_lookups == (1 if i == 0 else 0)


def test_an_expensive_kb_affords_a_probe_on_every_step(knn_setups, knn_prompts, monkeypatch, always_direct):
    """A KB call costs 60 ms (5% of it: 3 ms, well above a small fill and lookup even on a
    loaded CI machine; at 20 ms a run beside another test worker skipped 4 probes): the cache
    is filled and guesses on every direct step, and OS3 hears each guess."""
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["hnsw"]
    prompt = knn_prompts[1]
    base = run_knn_seq(prompt, lm, kb, KNN, REQ)
    monkeypatch.setattr(kb, "search_vectors", _slowed(kb.search_vectors, 0.060))
    heard = []
    real_record = StrideScheduler.record_direct

    def record(self, right, b, lookup=None):
        heard.append(right)
        return real_record(self, right, b, lookup)

    monkeypatch.setattr(StrideScheduler, "record_direct", record)
    got = run_knn_spec(prompt, lm, kb, KNN, REQ, SPEC)
    assert got.tokens == base.tokens
    st = got.stats
    assert st.direct_steps == MAX_NEW - 1 == len(heard)
    probes = [r for r in heard if r is not None]
    assert len(probes) == st.cache_lookups >= MAX_NEW - 3
    assert sum(probes) == st.shadow_hits
    assert st.gamma is not None and st.cache_entries > 0


def test_the_budget_is_a_share_of_the_kb_time(knn_setups, knn_prompts, monkeypatch, always_direct):
    """The cache work of direct steps, timed from outside, stays within the budget plus one
    probe (the probe allowed last may overshoot by its own cost)."""
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["hnsw"]
    prompt = knn_prompts[2]
    base = run_knn_seq(prompt, lm, kb, KNN, REQ)
    cache = new_cache(kb, KNN, SPEC)
    spent = {"cache": 0.0, "kb": 0.0}

    def timed(fn, key, sleep=0.0):
        def run(*a, **kw):
            t0 = time.perf_counter()
            time.sleep(sleep)
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0

        return run

    monkeypatch.setattr(cache, "insert_hits", timed(cache.insert_hits, "cache", 0.002))
    monkeypatch.setattr(cache, "search", timed(cache.search, "cache", 0.002))
    monkeypatch.setattr(kb, "search_vectors", timed(kb.search_vectors, "kb", 0.004))
    got = run_knn_spec(prompt, lm, kb, KNN, REQ, SPEC, cache=cache)
    assert got.tokens == base.tokens
    assert got.stats.cache_lookups >= 1  # ~100 ms of KB time afford some probes
    probe = 0.004 + 0.005  # a fill and a lookup, with some slack for the real work
    assert spent["cache"] <= C.SHADOW_BUDGET * spent["kb"] + probe


def test_a_window_after_direct_steps_sees_the_last_kb_answer(knn_setups, knn_prompts, monkeypatch):
    """The pending fill: after unprobed direct steps, the first speculative step inserts the
    last direct step's KB answer before it looks up (the cache is not empty)."""
    monkeypatch.setattr(shadow_budget, "LAST_PROBE_COST", {})
    decisions = iter([0, 0, 0, 0] + [1] * 100)
    monkeypatch.setattr(StrideScheduler, "next_stride", lambda self, position=None, remaining=None: next(decisions))
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["hnsw"]
    prompt = knn_prompts[3]
    base = run_knn_seq(prompt, lm, kb, KNN, REQ)
    cache = new_cache(kb, KNN, SPEC)
    sizes = []
    real_search = cache.search

    def search(q, k):
        sizes.append(len(cache))
        return real_search(q, k)

    monkeypatch.setattr(cache, "search", search)
    monkeypatch.setattr(ShadowBudget, "allowed", lambda self: False)  # no probes at all
    got = run_knn_spec(prompt, lm, kb, KNN, REQ, SPEC, cache=cache)
    assert got.tokens == base.tokens
    assert got.stats.direct_steps == 4 and got.stats.spec_steps > 0
    assert got.stats.cache_lookups == got.stats.spec_steps  # no probe filled the cache
    assert sizes and min(sizes) > 0
