"""OS3 stride scheduler: gamma estimate, b(s) model, and the stride it picks."""

from __future__ import annotations

import math

import pytest

from ralm import constants as C
from ralm.config import SpecConfig
from ralm.stride.beta_posterior import beta_cdf_int, beta_quantile_int
from ralm.stride.os3 import StrideScheduler, expected_verified, objective

CAPPED = {"gamma_estimate": "capped"}  # the paper's OS3 estimate


def test_expected_verified_matches_series():
    for g in (0.0, 0.3, 0.6, 0.9):
        for s in range(1, 8):
            assert expected_verified(g, s) == pytest.approx(sum(g**i for i in range(s)))


def test_worked_example_from_docstring():
    # a=10ms, b=40ms, gamma=0.6, synchronous -> s=3
    vals = {s: objective(s, 0.6, 0.010, 0.040, asynchronous=False) for s in range(1, 9)}
    assert max(vals, key=vals.get) == 3


def test_fixed_stride_when_not_adaptive():
    sch = StrideScheduler(SpecConfig(stride=5))
    sch.record_verification(5, 0, 0.1)
    assert sch.next_stride() == 5


def test_starts_at_one_and_grows_with_expensive_verification():
    picks = {}
    for est in ("capped", "bayes"):
        sch = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_estimate=est))
        assert sch.next_stride() == 1
        for _ in range(5):
            sch.record_step(0.010)
            sch.record_verification(1, 1, 0.200)  # always right, verification 20x a step
        picks[est] = sch.next_stride()
        assert picks[est] > 3
        if est == "capped":
            assert sch.gamma == pytest.approx(0.6)  # 5/(5+0) = 1 capped at gamma_max
        else:
            assert sch.gamma == pytest.approx(0.3 ** (1 / 6))  # Beta(6, 1): CDF x^6
    # five right windows are evidence the cap ignores: the posterior goes further
    assert picks["bayes"] > picks["capped"]


def test_beta_cdf_equals_the_binomial_tail_on_both_sides_of_the_mode():
    """The CDF sums whichever tail falls away from the mode; both agree with the plain
    binomial sum, also where a tail is far below a float's resolution."""
    for x in (1e-4, 0.05, 0.3, 0.5, 0.77, 0.999):
        for a, b in ((1, 1), (3, 40), (40, 3), (120, 7), (7, 120), (300, 300)):
            n = a + b - 1
            plain = sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(a, n + 1))
            assert beta_cdf_int(x, a, b) == pytest.approx(plain, rel=1e-9, abs=1e-12)
    assert 0 < beta_cdf_int(0.5, 400, 1) == pytest.approx(0.5**400, rel=1e-9)


def test_beta_quantile_closed_forms_and_the_docstring_example():
    for q in (0.1, 0.3, 0.5, 0.9):
        for n in (1, 2, 7, 40, 300):
            assert beta_quantile_int(q, n, 1) == pytest.approx(q ** (1 / n), abs=1e-8)
            assert beta_quantile_int(q, 1, n) == pytest.approx(1 - (1 - q) ** (1 / n), abs=1e-8)
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    assert sch.gamma is None and sch.optimistic_gamma() == pytest.approx(0.7)
    got = []
    for s, matched in ((1, 1), (3, 3), (8, 6)):
        sch.record_verification(s, matched, 0.1)
        got.append(round(sch.gamma, 3))
    assert got == [0.548, 0.786, 0.809]


def test_a_mismatch_lowers_the_posterior_and_the_stride():
    def after(windows):
        sch = StrideScheduler(SpecConfig(adaptive_stride=True))
        for s, m in windows:
            sch.record_step(0.010)
            sch.record_verification(s, m, 0.200)
        return sch.gamma, sch.next_stride()

    g_ok, s_ok = after([(4, 4)] * 4)
    g_bad, s_bad = after([(4, 4), (4, 1), (4, 4), (4, 0)])
    assert g_bad < g_ok and s_bad < s_ok


def test_stays_small_when_speculation_is_always_wrong():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    for _ in range(5):
        sch.record_step(0.010)
        sch.record_verification(2, 0, 0.200)
    assert sch.gamma == pytest.approx(1 - 0.7 ** (1 / 6))  # Beta(1, 6): about 0.058
    # a step costs 1/20 of a verification: a second guess nearly free, so at most 2
    assert sch.next_stride() <= 2
    capped = StrideScheduler(SpecConfig(adaptive_stride=True, **CAPPED))
    for _ in range(5):
        capped.record_step(0.010)
        capped.record_verification(2, 0, 0.200)
    assert capped.gamma == 0.0 and capped.next_stride() == 1


def test_gamma_window_and_formula():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, os3_window=3, gamma_max=0.99, **CAPPED))
    sch.record_verification(4, 4, 0.1)  # old, falls out of the window
    sch.record_verification(4, 1, 0.1)
    sch.record_verification(3, 3, 0.1)
    sch.record_verification(2, 0, 0.1)
    # window = (4,1), (3,3), (2,0): M = 4, fails = 2 -> 4/6
    assert sch.gamma == pytest.approx(4 / 6)


def test_verification_latency_linear_fit():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, **CAPPED))
    for s in (1, 2, 4, 8):
        sch.record_verification(s, s, 0.010 + 0.005 * s)
    assert sch.verify_latency(6) == pytest.approx(0.040)


def test_bayes_b_is_interpolated_per_size_non_decreasing_and_flat_beyond():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    sch.record_kb_latency(1, 0.10)
    sch.record_verification(1, 1, 0.20)  # b(1) = mean 0.15
    sch.record_verification(2, 2, 0.26)
    sch.record_verification(4, 4, 0.22)  # noise below b(2): b(4) held at 0.26
    sch.record_verification(8, 8, 0.30)
    assert sch.verify_latency(1) == pytest.approx(0.15)
    assert sch.verify_latency(3) == pytest.approx(0.26)
    assert sch.verify_latency(6) == pytest.approx(0.28)
    assert sch.verify_latency(16) == pytest.approx(0.30)  # flat beyond the largest size measured


def test_one_costly_batch_of_two_does_not_lock_the_stride_at_one():
    """The int8 scan at 4M rows: b(1) = 0.17 s, and one batch of 2 measured at 0.40 s (a
    noisy call). The paper's line through them predicts b(8) = 1.78 s and keeps s <= 1,
    which never measures a larger batch again; the per-size model tries a long stride,
    measures it (b(16) = 0.37 s in truth) and keeps long strides."""

    def scheduler(**kw):
        sch = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=16, **kw))
        sch.record_generation(0.037)
        sch.record_step(0.045)
        sch.record_kb_latency(1, 0.17)
        for _ in range(6):
            sch.record_verification(1, 1, 0.17)
        sch.record_verification(2, 2, 0.40)
        return sch

    line = scheduler(**CAPPED, gamma_max=0.95)
    assert line.next_stride() <= 1  # s = 1, or direct steps: either way no batch is ever measured
    sch = scheduler()
    s = sch.next_stride()
    assert s >= 8
    sch.record_verification(s, s, 0.37)  # the real b(16) of the int8 scan
    assert sch.next_stride() >= 8


def test_a_kb_whose_batches_cost_s_queries_falls_back_to_short_strides():
    """Flat extrapolation is optimistic: a long stride is tried once; on a KB where a
    batch of s costs s single queries its measurement brings the stride back down."""
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=16, allow_direct=False))
    sch.record_generation(0.037)
    sch.record_step(0.045)
    for _ in range(4):
        sch.record_verification(1, 1, 0.10)
    tried = []
    for _ in range(8):
        s = sch.next_stride()
        tried.append(s)
        sch.record_verification(s, s, 0.10 * s)
    assert max(tried) > 2  # explored
    assert sum(s > 2 for s in tried) <= 3 and tried[-3:] == [1, 1, 1], tried


def test_a_start_up_cost_curve_shapes_b_beyond_the_sizes_measured():
    """With the KB's start-up timings, b(s) beyond the largest measured size follows the
    curve, scaled to the measured mean (the module docstring's example); measured sizes
    keep their means, and a non-monotone curve is made non-decreasing."""
    sch = StrideScheduler(SpecConfig(adaptive_stride=True), cost_curve={1: 1.0, 4: 1.3, 16: 3.4})
    sch.record_kb_latency(1, 0.17)
    assert sch.verify_latency(1) == pytest.approx(0.17)
    assert sch.verify_latency(8) == pytest.approx(0.34)
    assert sch.verify_latency(16) == pytest.approx(0.578)
    sch.record_verification(4, 4, 0.30)  # measured: b(4) is its own mean, the curve goes on from it
    assert sch.verify_latency(4) == pytest.approx(0.30)
    assert sch.verify_latency(16) == pytest.approx(0.30 * 3.4 / 1.3)
    bumpy = StrideScheduler(SpecConfig(adaptive_stride=True), cost_curve={1: 1.0, 4: 0.9, 16: 2.0})
    bumpy.record_kb_latency(1, 0.1)
    assert bumpy.verify_latency(4) == pytest.approx(0.1) and bumpy.verify_latency(16) == pytest.approx(0.2)


@pytest.mark.parametrize("per_query", [1.0, 0.02])
def test_the_first_decisions_follow_the_kbs_measured_batch_curve(per_query):
    """A KB whose batch of s costs s queries (FAISS's per-query scan) against one whose batch
    costs about one query (a shared pass): with the start-up curve, the first decisions after
    the warm-up call are already short in the first case and longer in the second; without
    it, both start by trying a longer stride (flat extrapolation)."""

    def first_strides(curve):
        sch = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=16, allow_direct=False), cost_curve=curve)
        sch.record_generation(0.037)
        sch.record_step(0.045)
        for _ in range(4):
            sch.record_verification(1, 1, 0.10)  # four matched windows of one step
        return sch.next_stride()

    curve = {b: 1.0 + per_query * (b - 1) for b in (1, 4, 16)}
    seeded, flat = first_strides(curve), first_strides(None)
    assert flat > 2
    if per_query == 1.0:
        assert seeded <= 2
    else:
        assert seeded > 2


def test_async_objective_prefers_longer_or_equal_stride_when_b_is_hidden():
    a, b, g = 0.010, 0.012, 0.6
    sync = max(range(1, 9), key=lambda s: objective(s, g, a, b, False))
    asy = max(range(1, 9), key=lambda s: objective(s, g, a, b, True))
    assert asy >= 1 and objective(asy, g, a, b, True) >= objective(sync, g, a, b, False)


def test_max_stride_bound():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, max_stride=4))
    for _ in range(5):
        sch.record_step(0.001)
        sch.record_verification(1, 1, 10.0)
    assert sch.next_stride() == 4


def _feed(sch, gen_s, verify_s, direct_s=None, matched=1, n=5):
    for _ in range(n):
        sch.record_generation(gen_s)
        sch.record_step(gen_s + 0.001)
        sch.record_verification(1, matched, verify_s)
        if direct_s is not None:
            sch.record_direct(True, direct_s)


def test_direct_retrieval_chosen_when_retrieval_is_cheap():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    _feed(sch, gen_s=0.040, verify_s=0.001)  # rollbacks cost 40 ms, retrieval 1 ms
    assert sch.next_stride() == 0


def test_speculation_chosen_when_retrieval_is_expensive():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    _feed(sch, gen_s=0.040, verify_s=0.400)
    assert sch.next_stride() >= 3


def test_direct_disabled_by_config():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, allow_direct=False))
    _feed(sch, gen_s=0.040, verify_s=0.001)
    assert sch.next_stride() == 1


def test_correction_cost_counts_in_rate():
    a, b, g = 0.04, 0.001, 0.6
    assert objective(2, g, a, b, False, correction=a) < objective(2, g, a, b, False)


def test_first_decision_after_warm_up_is_direct_when_retrieval_is_cheap():
    # after step 0 there is a KB latency (the warm-up call) and a generation time but no
    # accuracy yet: even at the optimistic prior gamma = gamma_max, speculation cannot pay
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    sch.record_kb_latency(1, 0.001)
    sch.record_generation(0.040)
    assert sch.gamma is None and sch.next_stride() == 0


def test_first_decision_after_warm_up_starts_at_one_when_retrieval_is_expensive():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    sch.record_kb_latency(1, 0.400)
    sch.record_generation(0.040)
    assert sch.next_stride() == 1  # the paper's start, not the optimum at the prior


def test_first_decision_without_direct_extension_is_one():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, allow_direct=False))
    sch.record_kb_latency(1, 0.001)
    sch.record_generation(0.040)
    assert sch.next_stride() == 1


def test_step_latency_before_any_speculative_step_is_generation_plus_lookup():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True))
    assert sch.step_latency() is None
    sch.record_generation(0.030)
    sch.record_direct(True, 0.002, lookup_s=0.010)
    assert sch.step_latency() == pytest.approx(0.040)
    sch.record_step(0.050)  # a measured speculative step takes over
    assert sch.step_latency() == pytest.approx(0.050)


def test_lookup_measured_at_warm_up_counts_in_step_latency_and_decides_start():
    # ADR-like costs: the query encoding (12 ms) dominates retrieval, the search is 2 ms.
    # Counting the encoding in a (a speculative step pays it) makes direct steps win at the
    # start; without it, the same numbers would start speculating.
    def sched(lookup):
        s = StrideScheduler(SpecConfig.named("PSA"))
        s.record_generation(0.018)
        if lookup:
            s.record_lookup(0.012)
        s.record_kb_latency(1, 0.002 if lookup else 0.014)
        return s

    assert sched(True).step_latency() == pytest.approx(0.030)
    assert sched(True).next_stride() == 0
    assert sched(False).next_stride() == 1


# ---- the rate check (bayes mode): realized costs veto a model that says speculate
def _expensive(sch):
    _feed(sch, gen_s=0.040, verify_s=0.400)  # the model says: speculate, long strides
    assert sch.next_stride() >= 3


def test_speculation_measured_dearer_than_direct_steps_is_vetoed_then_re_explored():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_prior=False))
    _expensive(sch)
    for _ in range(3):
        sch.record_realized(True, 0.440, 1)  # a direct step: 440 ms
    sch.record_realized(False, 3.0, 6)  # windows: 500 ms per committed step ...
    assert sch.next_stride() >= 3  # ... but only 6 steps measured: no verdict yet
    sch.record_realized(False, 1.0, 2)
    assert sch.speculation_loses()
    picks = [sch.next_stride() for _ in range(C.RATE_CHECK_EXPLORE + 1)]
    assert picks[:-1] == [0] * C.RATE_CHECK_EXPLORE and picks[-1] >= 3  # then one window re-measures
    assert sch.vetoes == C.RATE_CHECK_EXPLORE


def test_speculation_measured_cheaper_is_kept_and_the_margin_counts():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_prior=False))
    _expensive(sch)
    for _ in range(3):
        sch.record_realized(True, 0.440, 1)
    sch.record_realized(False, 0.440 * (1 + C.RATE_CHECK_MARGIN / 2) * 8, 8)  # within the margin
    assert not sch.speculation_loses() and sch.next_stride() >= 3
    sch.record_realized(False, 0.440 * 1.5 * 8, 8)  # now 1.25x a direct step on average
    assert sch.speculation_loses()


def test_without_direct_steps_the_check_uses_generation_plus_b1():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_prior=False))
    _expensive(sch)  # generation 40 ms, b(1) 400 ms: a direct step ~ 440 ms
    sch.record_realized(False, 0.470 * 8, 8)
    assert sch.speculation_loses()
    sch2 = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_prior=False))
    _expensive(sch2)
    sch2.record_realized(False, 0.300 * 8, 8)
    assert not sch2.speculation_loses()


def test_the_papers_capped_estimate_has_no_rate_check():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, **CAPPED))
    _feed(sch, gen_s=0.040, verify_s=0.400)
    for _ in range(3):
        sch.record_realized(True, 0.100, 1)
    sch.record_realized(False, 10.0, 10)
    assert sch.next_stride() >= 1 and sch.vetoes == 0


def test_realized_costs_carry_to_the_next_request_through_the_prior():
    from ralm.stride.gamma_prior import GammaPrior

    prior = GammaPrior()
    first = StrideScheduler(SpecConfig(adaptive_stride=True), prior=prior, prior_key="kb")
    _expensive(first)
    for _ in range(4):
        first.record_realized(True, 0.440, 1)
    first.record_realized(False, 0.600 * 10, 10)
    first.finish()
    assert prior.realized("kb") == (pytest.approx(6.0), 10, pytest.approx(1.76), 4)
    second = StrideScheduler(SpecConfig(adaptive_stride=True), prior=prior, prior_key="kb")
    _feed(second, gen_s=0.040, verify_s=0.400)  # the model alone would speculate (first request)
    assert second.speculation_loses() and second.next_stride() == 0  # known from the first request


def _overlapping(prior=None, prior_key=None, **cfg) -> StrideScheduler:
    """PSA's scheduler after its first step: b(1) = 170 ms measured with nothing overlapping
    it (the first step's KB call), verifications of 4 cost 200 ms."""
    spec = SpecConfig(adaptive_stride=True, async_verify=True, **cfg)
    sch = StrideScheduler(spec, prior=prior, prior_key=prior_key, cost_curve={1: 1.0, 4: 1.2})
    sch.record_kb_latency(1, 0.170)
    return sch


def test_overlap_that_hides_the_step_keeps_verification_asynchronous():
    sch = _overlapping(gamma_prior=False)
    # a step of 40 ms beside a verification of 4 (200 ms one after the other: 240 ms): the
    # phase takes the verification's 200 ms, ratio 0.83
    for _ in range(3):
        sch.record_overlap(0.200, 4, 0.040)
    assert sch.overlap_ratio() == pytest.approx(0.200 / (0.040 + 0.170 * 1.2))
    assert all(sch.async_pays() for _ in range(20)) and sch.overlap_off == 0


def test_overlap_that_saves_nothing_is_turned_off_then_re_measured():
    sch = _overlapping(gamma_prior=False)
    assert sch.async_pays()  # nothing measured: overlap, as configured
    sch.record_overlap(0.250, 4, 0.040)  # contention: the phase costs the step and the call
    assert sch.overlap_ratio() is None and sch.async_pays()  # one window is not evidence
    sch.record_overlap(0.245, 4, 0.040)
    assert sch.overlap_ratio() > 1 - C.OVERLAP_CHECK_MARGIN
    picks = [sch.async_pays() for _ in range(C.OVERLAP_CHECK_EXPLORE + 1)]
    assert picks == [False] * C.OVERLAP_CHECK_EXPLORE + [True]  # then one window re-measures
    assert sch.overlap_off == C.OVERLAP_CHECK_EXPLORE
    # the stride model of synchronous windows follows: the same stride as a PS scheduler fed alike
    ps = StrideScheduler(SpecConfig(adaptive_stride=True, gamma_prior=False), cost_curve={1: 1.0, 4: 1.2})
    for s in (sch, ps):
        _feed(s, gen_s=0.040, verify_s=0.170)
    assert sch.best_stride(0.9, 0.040) == ps.best_stride(0.9, 0.040)


def test_the_overlap_check_needs_an_unoverlapped_call_and_leaves_fixed_strides_alone():
    sch = StrideScheduler(SpecConfig(adaptive_stride=True, async_verify=True, gamma_prior=False))
    sch.record_verification(4, 4, 0.300, overlapped=True)  # only overlapped calls: no price for serial
    for _ in range(3):
        sch.record_overlap(0.300, 4, 0.040)
    assert sch.overlap_ratio() is None and sch.async_pays()
    fixed = StrideScheduler(SpecConfig(stride=4, async_verify=True))
    fixed.record_kb_latency(1, 0.170)
    for _ in range(3):
        fixed.record_overlap(0.300, 4, 0.040)
    assert all(fixed.async_pays() for _ in range(20))  # a fixed stride is what its caller asked for
    assert not StrideScheduler(SpecConfig(adaptive_stride=True)).async_pays()  # not configured
    unchecked = _overlapping(gamma_prior=False, overlap_check=False)  # asked to overlap always
    for _ in range(3):
        unchecked.record_overlap(0.300, 4, 0.040)
    assert unchecked.overlap_ratio() > 1 and all(unchecked.async_pays() for _ in range(20))


def test_the_overlap_verdict_carries_to_the_next_request_through_the_prior():
    from ralm.stride.gamma_prior import GammaPrior

    prior = GammaPrior()
    first = _overlapping(prior=prior, prior_key="kb")
    for _ in range(2):
        first.record_overlap(0.250, 4, 0.040)
    first.finish()
    assert prior.overlap("kb") == [pytest.approx(0.250 / (0.040 + 0.170 * 1.2))]
    second = _overlapping(prior=prior, prior_key="kb")
    assert second.async_pays()  # one earlier request is one sample: not yet evidence
    second.record_overlap(0.250, 4, 0.040)
    assert not second.async_pays()  # its own window and the earlier request's agree
