"""RaLMSpec loop logic with scripted parts: rollback positions, EOS, limits, async.

The scripted generator/KB (tests/factories.py) make the KB's document a function of
the step index, so each test places the first mismatch exactly where it wants.
"""

from __future__ import annotations

import pytest

from ralm.config import RequestConfig, SpecConfig
from ralm.seq import run_seq
from ralm.spec import run_spec
from tests.factories import ScriptedGenerator, ScriptedKB, VirtualClock

Q = "what is the answer to this"  # 6 tokens
K = 4


def pipeline(schedule, eos_at=None, max_new=48, **kb_kw):
    gen = ScriptedGenerator(eos_at=eos_at)
    gen.encode_question(Q)
    kb = ScriptedKB(schedule=schedule, n_q=6, k=K, **kb_kw)
    return gen, kb, RequestConfig(max_new_tokens=max_new, generation_stride=K)


def both(schedule, spec, **kw):
    gen, kb, req = pipeline(schedule, **kw)
    base = run_seq(Q, gen, kb, req)
    gen2, kb2, req2 = pipeline(schedule, **kw)
    out = run_spec(Q, gen2, kb2, req2, spec)
    return base, out, gen2, kb2


def test_baseline_follows_schedule():
    base, _, _, _ = both({2: 7}, SpecConfig())
    assert base.stats.doc_ids[:4] == [0, 0, 7, 0]
    assert base.stats.kb_calls == 12 and len(base.tokens) == 48


@pytest.mark.parametrize("pos", [0, 1, 2], ids=["first", "middle", "last"])
def test_mismatch_position_in_window(pos):
    # window of s=3 starting at step 4 (step 0 runs on the warm-up retrieval, steps 1..3
    # form the first window). The cache only holds doc 0, so a new doc at step 4+pos is a
    # guaranteed mismatch at that position.
    spec = SpecConfig(stride=3)
    base, out, gen, kb = both({4 + pos: 9}, spec)
    assert out.tokens == base.tokens
    assert out.stats.doc_ids == base.stats.doc_ids
    assert out.stats.rollbacks == 1
    # tokens after the mismatch position inside the window were regenerated
    assert out.stats.regenerated_tokens == (3 - pos) * K
    # the correction step used the KB's document 9
    assert (9, 6 + (4 + pos) * K, K) in gen.calls


def test_no_mismatch_means_one_kb_call_per_window():
    spec = SpecConfig(stride=4)
    base, out, _, kb = both({}, spec)
    assert out.tokens == base.tokens
    assert out.stats.rollbacks == 0
    # 12 steps: step 0 on the initial retrieval (never re-verified), then windows of
    # 4, 4 and 3 -> 3 verifications
    assert kb.calls == [1, 4, 4, 3]
    assert out.stats.kb_queries == 12 and out.stats.spec_steps == 11


def test_first_step_uses_the_warm_up_retrieval():
    # the warm-up KB call answers step 0's own query, so step 0 is never speculated and
    # its query is never sent again; with s=1 and no mismatch that is one call per step
    spec = SpecConfig(stride=1)
    base, out, gen, kb = both({}, spec)
    assert out.tokens == base.tokens
    assert kb.calls == [1] * 12 and out.stats.kb_calls == base.stats.kb_calls == 12
    assert out.stats.spec_steps == 11 and out.stats.cache_lookups == 11


def test_eos_inside_window():
    spec = SpecConfig(stride=8)
    base, out, _, _ = both({2: 3}, spec, eos_at=13)
    assert base.finish_reason == "stop" and len(base.tokens) == 13
    assert out.tokens == base.tokens and out.finish_reason == "stop"


def test_eos_speculated_then_rolled_back():
    # With the wrong doc, nothing special happens; EOS is at a fixed position, but a
    # mismatch before it must discard the EOS step and regenerate up to it.
    spec = SpecConfig(stride=8)
    base, out, _, _ = both({1: 4}, spec, eos_at=10)
    assert out.tokens == base.tokens and out.stats.rollbacks == 1


def test_max_new_tokens_inside_window():
    spec = SpecConfig(stride=8)
    base, out, _, _ = both({5: 2}, spec, max_new=22)  # 22 = 5 full steps + 2 tokens
    assert len(base.tokens) == 22
    assert out.tokens == base.tokens


def test_async_step_discarded_after_failed_verification():
    spec = SpecConfig(stride=2, async_verify=True)
    base, out, gen, _ = both({2: 5}, spec)
    assert out.tokens == base.tokens
    assert out.stats.async_steps_discarded >= 1
    assert out.stats.rollbacks == 1


def test_async_step_kept_after_successful_verification():
    spec = SpecConfig(stride=2, async_verify=True)
    base, out, _, kb = both({}, spec)
    assert out.tokens == base.tokens
    assert out.stats.async_steps_kept >= 1
    assert out.stats.rollbacks == 0


def test_async_verification_really_overlaps():
    # The verification runs in another thread while the next speculative step runs:
    # their wall-clock intervals intersect (behaviour, not a speed threshold).
    spec = SpecConfig(stride=2, async_verify=True)
    gen, kb, req = pipeline({}, search_sleep=0.05)
    gen.step_sleep = 0.05
    out = run_spec(Q, gen, kb, req, spec)
    verify_iv = kb.intervals[1:]  # skip the initial (synchronous) retrieval
    overlaps = sum(any(a0 < v1 and v0 < a1 for a0, a1 in gen.intervals) for v0, v1 in verify_iv)
    # every verification but the last (when generation is over, nothing is left to overlap)
    assert len(verify_iv) >= 4 and overlaps >= len(verify_iv) - 1
    assert out.stats.async_steps_kept > 0


@pytest.mark.parametrize("name", ["base", "P", "S", "A", "PS", "PA", "SA", "PSA"])
@pytest.mark.parametrize("stride", [1, 3, 8])
def test_all_configurations_scripted(name, stride):
    schedule = {1: 3, 2: 3, 5: 8, 6: 1, 7: 8, 9: 2}
    spec = SpecConfig.named(name, stride=stride)
    base, out, _, _ = both(schedule, spec)
    assert out.tokens == base.tokens
    assert out.stats.doc_ids == base.stats.doc_ids


def test_prefetch_reduces_rollbacks_when_doc_seen_before():
    # doc 3 is the KB's choice for step 1 and again for step 6; with prefetch the KB's
    # top-20 for every query contains all low ids, so re-visits are cache hits.
    schedule = {1: 3, 6: 3}
    plain = both(schedule, SpecConfig(stride=2))[1]
    pre = both(schedule, SpecConfig(stride=2, prefetch=True, prefetch_size=20))[1]
    assert pre.tokens == plain.tokens
    assert pre.stats.rollbacks < plain.stats.rollbacks


def test_direct_steps_are_exact_and_counted(monkeypatch):
    # a cheap KB and a slow generator: OS3 falls back to direct (s = 0) steps (virtual time:
    # the decision must not depend on the machine's load)
    VirtualClock().install(monkeypatch)
    schedule = {1: 3, 2: 3, 5: 8, 6: 1, 7: 8, 9: 2}
    gen, kb, req = pipeline(schedule)
    base = run_seq(Q, gen, kb, req)
    gen2, kb2, req2 = pipeline(schedule)
    gen2.step_sleep = 0.01
    out = run_spec(Q, gen2, kb2, req2, SpecConfig(adaptive_stride=True))
    assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
    assert out.stats.direct_steps > 0


def test_cheap_retrieval_never_speculates_so_never_rolls_back(monkeypatch):
    # With retrieval far cheaper than a generation step, OS3 decides on direct steps from
    # the first decision (after the warm-up call), so no speculative step is ever thrown
    # away: PSA does RaLMSeq's work plus shadow guesses, one KB call per step. Virtual time
    # (a 0.1 ms search, a 10 ms step): a stall of the machine inside a search must not make
    # retrieval look dear.
    VirtualClock().install(monkeypatch)
    schedule = {1: 3, 2: 3, 5: 8, 6: 1, 7: 8, 9: 2}
    gen, kb, req = pipeline(schedule, search_sleep=1e-4)
    gen.step_sleep = 0.01
    out = run_spec(Q, gen, kb, req, SpecConfig.named("PSA"))
    assert out.stats.spec_steps == 0 and out.stats.rollbacks == 0
    assert out.stats.regenerated_tokens == 0 and out.stats.async_steps_discarded == 0
    assert out.stats.kb_calls == out.stats.steps == 12 and out.stats.direct_steps == 11


def test_direct_steps_count_their_shadow_guess_as_a_lookup(monkeypatch):
    # a direct step still asks the cache (its guess keeps gamma current): that is a lookup,
    # and a right guess a shadow hit, so the hit rate exists for all-direct requests too. The
    # KB takes 20 ms, so the probe budget (5% of it: 1 ms) affords a guess on every step;
    # every step is made direct (OS3 would speculate on so dear a KB)
    from ralm.stride.os3 import StrideScheduler

    real = StrideScheduler.next_stride

    def direct(self, position=None, remaining=None):
        real(self, position, remaining)  # keeps the scheduler's own bookkeeping
        self.decisions[-1] = 0
        return 0

    monkeypatch.setattr(StrideScheduler, "next_stride", direct)
    VirtualClock().install(monkeypatch)  # the budget's sums are the scripted costs, whatever the load
    schedule = {1: 3, 2: 3, 5: 8, 6: 1, 7: 8, 9: 2}
    gen, kb, req = pipeline(schedule, search_sleep=0.02)
    gen.step_sleep = 0.01
    st = run_spec(Q, gen, kb, req, SpecConfig.named("PSA")).stats
    assert st.spec_steps == 0 and st.direct_steps == 11
    assert st.cache_lookups == st.direct_steps
    # this scripted cache guesses every step right (gamma, the posterior's quantile after n
    # right guesses, Beta(n + 1, 1), says so): all shadow hits
    assert st.gamma == pytest.approx(SpecConfig().gamma_quantile ** (1 / (1 + st.direct_steps)))
    assert st.shadow_hits == st.direct_steps


def test_the_gamma_prior_carries_to_the_next_request_and_outputs_stay_exact(monkeypatch):
    """A second request to the same KB with the same settings starts from the first one's
    evidence: its first window is longer than s = 1; every output still equals RaLMSeq's."""
    VirtualClock().install(monkeypatch)
    spec = SpecConfig.named("PS", max_stride=8, allow_direct=False)

    def run(cfg):
        gen, kb, req = pipeline({}, max_new=96, search_sleep=0.02)  # retrieval dearer than a step
        return run_spec(Q, gen, kb, req, cfg)

    gen, kb, req = pipeline({}, max_new=96)
    base = run_seq(Q, gen, kb, req)
    first, second = run(spec), run(spec)
    assert first.tokens == base.tokens == second.tokens
    assert first.stats.strides[0] == 1 and second.stats.strides[0] > 1
    assert run(spec.model_copy(update={"gamma_prior": False})).stats.strides[0] == 1


class SharedScriptedKB(ScriptedKB):
    """A scripted KB that, like the served verifier, takes the speculation hint; it logs the
    hints and the KB calls in the order they happen."""

    def __init__(self, *a, load: int = 1, others: float | None = None, **kw):
        super().__init__(*a, **kw)
        self.log: list[str] = []
        self.load = load  # requests sharing the KB, as the served verifier reports
        self.others = others  # other requests' queries per answering search, as the served verifier reports

    def others_per_search(self) -> float | None:
        return self.others

    def speculating(self) -> None:
        self.log.append("hint")

    def sharing(self) -> int:
        return self.load

    def batch_search(self, queries, k):
        self.log.append(f"kb{len(queries)}")
        return super().batch_search(queries, k)


def test_a_shared_kb_hears_each_window_before_its_speculative_steps_and_tokens_stay_exact():
    """RaLMSpec tells a KB shared with other requests (:class:`ralm.retrieval.base.SharedKB`)
    when a window opens: one hint per window, each before that window's verification call,
    none before the first (KB) step. The hint changes nothing that is committed."""
    from ralm.retrieval.base import SharedKB

    spec = SpecConfig(stride=3)
    gen, kb, req = pipeline({5: 9})
    base = run_seq(Q, gen, kb, req)
    gen2 = ScriptedGenerator()
    gen2.encode_question(Q)
    shared = SharedScriptedKB(schedule={5: 9}, n_q=6, k=K)
    assert isinstance(shared, SharedKB) and not isinstance(kb, SharedKB)
    out = run_spec(Q, gen2, shared, req, spec)
    assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
    assert out.stats.rollbacks == 1
    assert shared.log[0] == "kb1"  # the first step
    windows = shared.log[1:]
    # hint, verification, hint, verification, ...: one hint per window, each verified after it
    assert windows[0::2] == ["hint"] * out.stats.verifications
    assert [int(c[2:]) for c in windows[1::2]] == out.stats.strides


@pytest.mark.parametrize(
    "load, threshold, name, gated",
    [(16, 8, "PSA", True), (8, 8, "PS", True), (7, 8, "PSA", False), (16, 0, "PSA", False), (16, 8, "Ps=4", False)],
)
def test_a_crowded_shared_kb_makes_ralmspec_take_direct_steps(load, threshold, name, gated):
    """While at least ``shared_kb_direct_at`` requests share the KB, the adaptive scheduler's
    every decision is a direct step (one KB query per step, as RaLMSeq); below it, with the
    gate off (0), or with a fixed stride the loop speculates. Tokens equal RaLMSeq's."""
    spec = SpecConfig.parse(name, shared_kb_direct_at=threshold)
    gen, kb, req = pipeline({5: 9, 9: 3})
    base = run_seq(Q, gen, kb, req)
    gen2 = ScriptedGenerator()
    gen2.encode_question(Q)
    shared = SharedScriptedKB(schedule={5: 9, 9: 3}, n_q=6, k=K, load=load)
    out = run_spec(Q, gen2, shared, req, spec)
    assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
    st = out.stats
    if gated:
        assert st.load_direct_steps == st.direct_steps == st.steps - 1  # all but the first step
        assert st.verifications == 0 and "hint" not in shared.log
        assert st.cache_lookups == 0  # RaLMSeq's steps: no probe of the cache
        assert st.kb_calls == base.stats.kb_calls
    else:
        assert st.load_direct_steps == 0 and st.verifications > 0


@pytest.mark.parametrize(
    "others, curve, shared",
    [
        (3.0, {1: 1.0, 4: 1.3, 16: 3.4}, True),  # batches carry 3 other queries: a query adds 0.1 of a call
        (15.0, {1: 1.0, 4: 3.9, 16: 15.5}, True),  # a compute-bound scan: every query costs the same
        (0.0, {1: 1.0, 4: 1.3, 16: 3.4}, False),  # alone in its searches: OS3 decides
        (None, {1: 1.0, 4: 1.3, 16: 3.4}, False),  # the load is not known yet
        (3.0, None, False),  # no batch cost curve: nothing to price the shared queries with
    ],
)
def test_a_shared_kbs_batches_make_direct_steps_cheaper_than_windows(others, curve, shared, monkeypatch):
    """With other requests' queries in every search, the cost model (ralm/stride/load_gate.py)
    prices a window's queries by what they add to those searches: then a direct step is the
    cheaper step, every decision after the first measurements is ``direct_shared``, and the
    tokens are RaLMSeq's. Alone, without a known load or without a cost curve, OS3 speculates."""
    VirtualClock().install(monkeypatch)  # a 10 ms search, a step of no time: whatever the load
    spec = SpecConfig.parse("PSA", shared_kb_direct_at=0)
    gen, kb, req = pipeline({5: 9, 9: 3}, search_sleep=0.01)
    base = run_seq(Q, gen, kb, req)
    gen2 = ScriptedGenerator()
    gen2.encode_question(Q)
    kb2 = SharedScriptedKB(schedule={5: 9, 9: 3}, n_q=6, k=K, load=4, others=others, search_sleep=0.01)
    kb2.batch_cost_curve = curve
    out = run_spec(Q, gen2, kb2, req, spec)
    assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
    st = out.stats
    assert sum(st.stride_reasons.values()) == len(st.strides) + st.direct_steps  # one decision each
    if shared:
        assert st.stride_reasons.get("direct_shared", 0) == st.load_direct_steps == st.direct_steps == st.steps - 1
        assert st.verifications == 0 and st.cache_lookups == 0 and st.shared_queries == others
    else:
        assert "direct_shared" not in st.stride_reasons and st.stride_reasons.get("speculate", 0) >= 1


def test_the_cost_model_can_be_switched_off_and_the_backstop_still_counts():
    spec = SpecConfig.parse("PSA", shared_kb_direct_at=0, shared_kb_cost_model=False)
    gen, kb, req = pipeline({5: 9})
    gen2 = ScriptedGenerator()
    gen2.encode_question(Q)
    kb2 = SharedScriptedKB(schedule={5: 9}, n_q=6, k=K, load=16, others=15.0)
    kb2.batch_cost_curve = {1: 1.0, 4: 3.9, 16: 15.5}
    out = run_spec(Q, gen2, kb2, req, spec)
    assert out.tokens == run_seq(Q, gen, kb, req).tokens
    assert "direct_shared" not in out.stats.stride_reasons and out.stats.verifications > 0
    spec = SpecConfig.parse("PSA", shared_kb_direct_at=8, shared_kb_cost_model=False)
    gen3 = ScriptedGenerator()
    gen3.encode_question(Q)
    kb3 = SharedScriptedKB(schedule={5: 9}, n_q=6, k=K, load=16, others=15.0)
    out = run_spec(Q, gen3, kb3, req, spec)
    assert out.stats.stride_reasons == {"direct_crowded": out.stats.direct_steps} and out.stats.verifications == 0


def test_the_kbs_start_up_batch_curve_reaches_the_scheduler_and_changes_no_token(monkeypatch):
    """A KB that timed its batch sizes at start-up (exact dense) hands the curve to the
    stride scheduler; the output stays RaLMSeq's."""
    import ralm.spec as spec_mod
    from ralm.stride.os3 import StrideScheduler

    seen = []

    class Recording(StrideScheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append(self.cost_curve)

    monkeypatch.setattr(spec_mod, "StrideScheduler", Recording)
    curve = {1: 1.0, 4: 3.9, 16: 15.5}
    gen, kb, req = pipeline({5: 3, 9: 2})
    base = run_seq(Q, gen, kb, req)
    gen2, kb2, req2 = pipeline({5: 3, 9: 2})
    kb2.batch_cost_curve = curve
    out = run_spec(Q, gen2, kb2, req2, SpecConfig(adaptive_stride=True))
    assert seen == [curve] and out.tokens == base.tokens
