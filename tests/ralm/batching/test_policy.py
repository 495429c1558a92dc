"""The batching policy (ralm.batching.policy): a typed plan of one iteration, decode steps and
drafted windows first, prefill chunks under the token budget, and the rows that give logits."""

from __future__ import annotations

from types import SimpleNamespace as Step

import pytest

from ralm.batching.policy import ChunkKind, plan_iteration

pytestmark = pytest.mark.unit


def test_decode_steps_come_first_and_a_prefill_is_cut_to_the_budget():
    prefill = Step(done=False, pending=[1, 2, 3, 4, 5], verify=None)
    decode = Step(done=False, pending=[7], verify=None)
    plan = plan_iteration([prefill, decode], token_budget=4, max_sequences=8)
    assert [(c.step, c.kind, c.start, c.tokens, c.logit_rows) for c in plan] == [
        (decode, ChunkKind.DECODE, 0, 1, 1),
        (prefill, ChunkKind.PREFILL, 1, 3, 0),  # 2 tokens left to feed: no logits yet
    ]
    assert plan.tokens == 4 and plan.logit_rows == [0]
    # the prefill's last chunk gives its next-token logits, at the chunk's last row
    prefill.pending = [4, 5]
    plan = plan_iteration([prefill, decode], token_budget=4, max_sequences=8)
    assert [c.logit_rows for c in plan] == [1, 1] and plan.logit_rows == [0, 2]


def test_a_drafted_window_is_fed_whole_with_logits_at_every_row():
    draft = Step(done=False, pending=[3, 4, 5, 6], verify=[4, 5, 6])
    decode = Step(done=False, pending=[9], verify=None)
    prefill = Step(done=False, pending=list(range(10)), verify=None)
    plan = plan_iteration([prefill, draft, decode], token_budget=6, max_sequences=8)
    assert [(c.kind, c.tokens) for c in plan] == [(ChunkKind.VERIFY, 4), (ChunkKind.DECODE, 1), (ChunkKind.PREFILL, 1)]
    assert plan.logit_rows == [0, 1, 2, 3, 4]


def test_finished_steps_are_skipped_and_the_sequence_cap_holds():
    steps = [Step(done=i == 0, pending=[i], verify=None) for i in range(5)]
    plan = plan_iteration(steps, token_budget=100, max_sequences=2)
    assert [c.step for c in plan] == steps[1:3] and len(plan) == 2
    assert not plan_iteration([steps[0]], token_budget=100, max_sequences=2)
