"""The gamma prior carried between requests: scaling, bounds, keys, and its effect on the
stride (never on outputs: the exactness matrix runs with it on, the default)."""

from __future__ import annotations

import threading

import pytest

from ralm.config import SpecConfig
from ralm.stride.beta_posterior import beta_quantile_int
from ralm.stride.gamma_prior import GammaPrior
from ralm.stride.os3 import StrideScheduler


def test_evidence_is_scaled_to_the_weight_as_in_the_docstring():
    p = GammaPrior(requests=8, weight=32)
    assert p.evidence("k") == (0, 0)
    p.record("k", 150, 6)
    assert p.evidence("k") == (31, 1)
    assert round(beta_quantile_int(0.3, 1 + 31, 1 + 1), 2) == 0.93
    p.record("k", 4, 2)  # few observations: not scaled up
    assert p.evidence("other") == (0, 0)
    small = GammaPrior(weight=64)
    small.record("k", 10, 2)
    assert small.evidence("k") == (10, 2)


def test_only_the_last_requests_count_and_bad_counts_are_refused():
    p = GammaPrior(requests=2, weight=1000)
    p.record("k", 100, 0)
    p.record("k", 5, 5)
    p.record("k", 5, 5)  # the first request fell out
    assert p.evidence("k") == (10, 10)
    p.record("k", 0, 0)  # a request that never verified adds nothing
    assert p.evidence("k") == (10, 10)
    with pytest.raises(ValueError):
        p.record("k", -1, 0)
    with pytest.raises(ValueError):
        GammaPrior(requests=0)


def test_concurrent_records_are_all_kept():
    p = GammaPrior(requests=1000, weight=10**9)

    def worker():
        for _ in range(200):
            p.record("k", 1, 0)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.evidence("k") == (800, 0)


def _scheduler(prior, key="k", **kw):
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=16, **kw), prior=prior, prior_key=key)
    sch.record_generation(0.037)
    sch.record_step(0.05)
    sch.record_kb_latency(1, 0.18)
    return sch


def test_a_warm_prior_starts_the_next_request_with_a_long_stride():
    prior = GammaPrior()
    first = _scheduler(prior)
    assert first.gamma is None and first.next_stride(position=1) == 1  # nothing known: the paper's start
    for p in range(1, 21):
        first.next_stride(position=p)
        first.record_verification(1, 1, 0.18)
    first.next_stride(position=21)
    first.record_verification(8, 8, 0.30)
    first.finish()
    assert prior.evidence("k") == (28, 0)
    second = _scheduler(prior)
    assert second.gamma == pytest.approx(beta_quantile_int(0.3, 29, 1))
    assert second.next_stride(position=1) >= 8
    assert _scheduler(prior, key="another kb").next_stride() == 1  # keys do not mix


def test_a_request_whose_guesses_fail_pulls_its_estimate_down():
    prior = GammaPrior()
    prior.record("k", 31, 1)
    sch, ok = _scheduler(prior), _scheduler(prior)
    start = sch.gamma
    for _ in range(6):
        sch.record_verification(4, 0, 0.25)
        ok.record_verification(4, 4, 0.25)
    assert sch.gamma < 0.8 < start < ok.gamma
    assert sch.next_stride() < ok.next_stride()


def test_the_prior_is_off_for_the_papers_estimate_and_when_disabled():
    prior = GammaPrior()
    prior.record("k", 31, 1)
    assert _scheduler(prior, gamma_estimate="capped").gamma is None
    assert _scheduler(prior, gamma_prior=True).gamma is not None
    assert _scheduler(prior, gamma_prior=False).gamma is None


def test_latencies_carry_over_and_the_requests_own_measurements_join_them():
    prior = GammaPrior()
    first = _scheduler(prior)  # step 0.05 s, b(1) = 0.18 s
    first.record_step(0.03)
    first.record_verification(1, 1, 0.20)
    first.record_verification(8, 8, 0.30)
    first.finish()
    step, by_size = prior.latencies("k")
    assert step == pytest.approx(0.04) and by_size == pytest.approx({1: 0.19, 8: 0.30})
    second = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=16), prior=prior, prior_key="k")
    assert second.step_latency() == pytest.approx(0.04)
    assert second.verify_latency(8) == pytest.approx(0.30) and second.verify_latency(4) == pytest.approx(
        0.19 + 0.11 * 3 / 7
    )
    second.record_verification(8, 8, 0.50)  # its own measurement counts with the prior's
    assert second.verify_latency(8) == pytest.approx(0.40)
    assert prior.latencies("another kb") == (None, {})
