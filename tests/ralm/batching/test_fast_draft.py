"""Decode fast, verify exactly (ralm.batching.fast_draft): windows drafted on the plain kernels
and verified by the invariant forward give the invariant engine's tokens, whatever the plain
kernels compute; the drafts are counted."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ralm.batching.engine import StepCall
from ralm.batching.fast_draft import draftable, plain_kernels
from ralm.batching.invariant import InvariantLinear
from ralm.drafting import StepOptions
from ralm.step_request import StepRequest
from tests.factories import tiny_engine

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engines():
    """The invariant engine, and the same model with fast drafts of up to 4 tokens."""
    base = tiny_engine("llama", seed=4)
    fast = type(base)(base.model, base.tokenizer, base.cfg.model_copy(update={"fast_draft": 4}))
    return base, fast


def _calls(eng, n: int, seed: int, flare: float | None = None) -> list[StepRequest]:
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        q = eng.encode_question(f"what does module {i} do with {rng.choice(['files', 'paths', 'json'])}?")
        docs = (f"module {i} reads files and writes json, line by line.",) if i % 2 else None
        opts = StepOptions(flare_threshold=flare) if flare is not None else None
        k = rng.randint(2, 12)
        calls.append(StepRequest(tuple(q), k, doc_texts=docs, ignore_eos=bool(i % 3), owner=f"r{i}", options=opts))
    return calls


def _run(eng, calls, rounds: int = 3):
    """``rounds`` steps of each call, each continuing from the last; every step's output."""
    outs = []
    ctx = [list(c.context) for c in calls]
    for _ in range(rounds):
        step = [dataclasses.replace(c, context=tuple(ctx[i])) for i, c in enumerate(calls)]
        res = [f.result() for f in [eng.submit(r) for r in step]]
        outs.append(res)
        for i, r in enumerate(res):
            ctx[i] += r.tokens if r.tokens else [7]
    for c in calls:
        eng.release(str(c.owner))
    return outs


@pytest.mark.parametrize("flare", [None, 0.0045])
def test_drafted_windows_give_the_invariant_tokens(engines, flare):
    base, fast = engines
    want = _run(base, _calls(base, 10, seed=1, flare=flare))
    got = _run(fast, _calls(fast, 10, seed=1, flare=flare))
    drafted = accepted = 0
    for w_round, g_round in zip(want, got):
        for w, g in zip(w_round, g_round):
            assert (g.tokens, g.eos, g.low_confidence) == (w.tokens, w.eos, w.low_confidence)
            drafted += g.drafted_tokens
            accepted += g.accepted_tokens
    assert drafted > 0 and accepted <= drafted
    if flare is None:  # (the tiny random model's probabilities are below FLARE's threshold: it stops there)
        assert accepted > drafted // 2  # the plain kernels' tokens are mostly the invariant ones


def test_a_wrong_plain_kernel_costs_drafts_never_tokens(engines, monkeypatch):
    """Plain kernels that compute something else (noise on every plain linear layer): many
    drafts are rejected, and the tokens are still the invariant engine's."""
    base, fast = engines
    invariant_forward = InvariantLinear.forward

    def noisy(self, x):
        y = invariant_forward(self, x)
        if self.plain:
            g = torch.Generator().manual_seed(int(x.shape[0]) * 7 + self.out_features)
            y = y + torch.randn(y.shape, generator=g) * 2.0
        return y

    want = _run(base, _calls(base, 8, seed=5))
    monkeypatch.setattr(InvariantLinear, "forward", noisy)
    got = _run(fast, _calls(fast, 8, seed=5))
    drafted = accepted = 0
    for w_round, g_round in zip(want, got):
        for w, g in zip(w_round, g_round):
            assert (g.tokens, g.eos) == (w.tokens, w.eos)
            drafted += g.drafted_tokens
            accepted += g.accepted_tokens
    assert drafted > 0 and accepted < drafted


def test_plain_kernels_are_on_only_inside_the_block_and_only_decoding_steps_draft(engines):
    _, fast = engines
    layers = [m for m in fast.model.modules() if isinstance(m, InvariantLinear)]
    with plain_kernels(fast.model):
        assert all(m.plain for m in layers)
    assert not any(m.plain for m in layers)

    class Step:
        def __init__(self, **kw):
            self.__dict__.update(
                dict(done=False, is_feed=False, verify=None, drafter=None, pending=[5], tokens=[3]), **kw
            )
            self.call = StepCall((), [1], kw.pop("k", 4))

    assert draftable(Step())
    assert not draftable(Step(pending=[1, 2]))  # prefilling
    assert not draftable(Step(tokens=[]))  # the first token comes from the prefill
    assert not draftable(Step(tokens=[1, 2, 3]))  # one token left: nothing to draft
    assert not draftable(Step(verify=[4]))
    assert not draftable(Step(drafter=object()))
