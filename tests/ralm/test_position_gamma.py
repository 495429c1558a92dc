"""The positional gamma estimate: evidence per position bucket, per-step gammas, and the
strides OS3 picks from them (ralm/stride/position_gamma.py, ralm/stride/os3.py)."""

from __future__ import annotations

import pytest

from ralm import constants as C
from ralm.config import SpecConfig
from ralm.stride import os3
from ralm.stride.beta_posterior import beta_quantile_int
from ralm.stride.gamma_prior import GammaPrior
from ralm.stride.os3 import StrideScheduler, objective, window_rates
from ralm.stride.position_gamma import BUCKETS, PositionEvidence, bucket, scaled


def test_buckets_double_and_the_last_is_open_ended():
    assert [bucket(p) for p in range(9)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    assert bucket(15) == 4 and bucket(16) == 5 and bucket(10**6) == BUCKETS - 1
    assert bucket(-3) == 0


def test_a_window_is_evidence_for_the_buckets_its_steps_fall_in():
    ev = PositionEvidence()
    ev.add_window(6, 4, 2)  # steps 6, 7 matched (bucket 3), step 8 missed (bucket 4), 9 never checked
    ev.add_window(16, 3, 3)  # all matched, bucket 5
    assert ev.counts() == {3: (2, 0), 4: (0, 1), 5: (3, 0)}
    assert ev.totals() == (5, 1)


def test_the_docstring_worked_example():
    ev = PositionEvidence({0: (80, 1), 5: (40, 0), 4: (30, 5)})  # pooled 150 matched, 6 missed
    g = ev.step_gammas(8, 24, 0.3, C.POSITION_SHRINK)  # positions 8..31
    assert g[0] == pytest.approx(beta_quantile_int(0.3, 62, 7)) == pytest.approx(0.883, abs=1e-3)
    assert g[8] == pytest.approx(beta_quantile_int(0.3, 72, 2)) == pytest.approx(0.967, abs=1e-3)
    assert len(set(g[:8])) == 1 and len(set(g[8:])) == 1
    empty = ev.step_gammas(40, 1, 0.3, C.POSITION_SHRINK)[0]  # bucket 6: nothing seen
    assert empty == pytest.approx(beta_quantile_int(0.3, 32, 2)) == pytest.approx(0.928, abs=1e-3)


def test_an_empty_bucket_is_the_pooled_posterior_while_the_evidence_is_small():
    ev = PositionEvidence({2: (6, 1)})
    assert ev.step_gammas(100, 1, 0.3, 8) == [beta_quantile_int(0.3, 7, 2)]


def test_per_step_rates_reduce_to_the_papers_objective_when_every_gamma_is_equal():
    a, b = 0.03, {s: 0.1 + 0.01 * s for s in range(1, 11)}
    for asynchronous in (False, True):
        rates = window_rates([0.8] * 10, a, b, asynchronous, 0.02)
        for s in range(1, 11):
            assert rates[s - 1] == pytest.approx(objective(s, 0.8, a, b[s], asynchronous, 0.02))


def test_prior_position_evidence_is_scaled_per_bucket():
    assert scaled([(1, 100, 0), (1, 100, 0), (3, 3, 1)], 32) == {1: (32, 0), 3: (3, 1)}
    prior = GammaPrior(weight=32)
    prior.record("k", 60, 4, by_position={2: (10, 4), 5: (50, 0)})
    prior.record("k", 60, 0, by_position={5: (60, 0)})
    assert prior.position_evidence("k") == {2: (10, 4), 5: (32, 0)}
    assert prior.position_evidence("other") == {}


def _scheduler(estimate: str, prior: GammaPrior | None = None) -> StrideScheduler:
    """Costs of the EDR int8 scan at 4M rows (b(1) = 0.13 s, b(2) to b(16) = 0.33 s with
    the batch widths padded; a step 42 ms of which 27 ms generation), asynchronous
    verification."""
    sch = StrideScheduler(
        SpecConfig(adaptive_stride=True, async_verify=True, gamma_estimate=estimate),
        prior=prior,
        prior_key="k",
    )
    sch.record_generation(0.027)
    sch.record_step(0.042)
    sch.record_kb_latency(1, 0.13)
    sch.record_kb_latency(16, 0.33)
    return sch


def _feed_a_request(sch: StrideScheduler) -> None:
    """What the demo corpus shows: the document changes between steps 4 and 15, never after
    (windows of 2 from positions 1, 3, ..., 31; those from 5, 9 and 13 miss their second step)."""
    for start in range(1, 32, 2):
        sch.next_stride(position=start)
        sch.record_verification(2, 1 if start in (5, 9, 13) else 2, 0.33)


def _served(estimate: str, requests: int) -> StrideScheduler:
    """A new request's scheduler after ``requests`` such requests in this process."""
    prior = GammaPrior()
    for _ in range(requests):
        sch = _scheduler(estimate, prior)
        _feed_a_request(sch)
        sch.finish()
    return _scheduler(estimate, prior)


def test_positional_strides_are_short_where_guesses_fail_and_long_where_they_do_not():
    picks = {}
    for est in ("positional", "bayes"):
        sch = _served(est, 3)
        picks[est] = (sch.next_stride(position=5), sch.next_stride(position=20))
    assert picks["positional"][0] < 4 and picks["positional"][1] >= 8, picks
    assert picks["bayes"][0] == picks["bayes"][1]  # one gamma: the position cannot matter
    assert picks["positional"][1] > picks["bayes"][1]


def test_the_next_request_starts_from_the_buckets_of_the_last():
    prior = GammaPrior()
    first = _scheduler("positional", prior)
    _feed_a_request(first)
    first.finish()
    assert set(prior.position_evidence("k")) == {1, 2, 3, 4, 5, 6}  # positions 1 to 32
    assert prior.position_evidence("k")[4] == (6, 2)  # positions 8-15: windows from 9, 11, 13, 15
    fresh = _scheduler("positional")
    assert fresh.next_stride(position=1) == 1  # nothing known: the paper's start
    second = _scheduler("positional", prior)
    assert second.step_gammas(0.5, 24)[20] > second.step_gammas(0.5, 24)[8]  # position 21 vs 9


def test_planning_to_the_end_avoids_a_short_last_window():
    """With every guess right so far and a KB call worth several steps, the stride from
    position 20 of a 32-step request covers the 12 steps left in one window."""
    sch = _served("positional", 3)
    assert sch.next_stride(position=20, remaining=12) == 12
    assert sch.next_stride(position=26, remaining=6) == 6


def test_names_choose_the_estimate():
    assert SpecConfig.parse("PSA").gamma_estimate == "positional" == SpecConfig().gamma_estimate
    assert SpecConfig.parse("PSA@bayes").gamma_estimate == "bayes"
    assert SpecConfig.parse("S@Positional").gamma_estimate == "positional"
    assert SpecConfig.parse("PSA@0.6").gamma_estimate == "capped"


def test_whether_to_speculate_is_decided_on_the_pooled_gamma(monkeypatch):
    """BM25-like costs (a KB call 8 ms, a generation step 31 ms): speculation is nearly free
    when it is right and costs a correction when it is not. The stable tail of the request
    alone would say speculate; the request as a whole (pooled gamma) says direct steps, and
    that decides, as it does for the 'bayes' estimate."""
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, async_verify=True), prior=None)
    sch.record_generation(0.031)
    sch.record_step(0.033)
    sch.record_kb_latency(1, 0.008)
    for _request in range(8):  # guesses mostly wrong in steps 1-15, right in 16-31
        for start in range(1, 32):
            sch.next_stride(position=start)
            sch.record_verification(1, int(start >= 16 or start % 4 == 0), 0.008)
    direct_rate = 1 / (0.031 + 0.008 + 0.002)  # generation + b(1) + the lookup part of a step
    sch._position = 20
    assert sch.best_stride(sch.gamma, 0.033, remaining=12)[1] > direct_rate  # the tail's own plan
    assert sch.best_stride(sch.gamma, 0.033, pooled=True)[1] < direct_rate
    planned = []
    real_plan = os3.finish_time_stride
    monkeypatch.setattr(os3, "finish_time_stride", lambda *a, **kw: planned.append(1) or real_plan(*a, **kw))
    assert sch.next_stride(position=20, remaining=12) == 0
    assert not planned  # a direct step is not planned to the request's end (it costs ~0.5 ms)
    assert sch.next_stride(position=2, remaining=12) == 0
    assert not planned
