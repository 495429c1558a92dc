"""The generator deployment's body in-process (no Ray): concurrent ``await server.step(...)``
calls share the continuous batcher's forward passes and each returns the tokens of the step
run alone; without the batcher (``invariant=false``) steps still run, one at a time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.generator import GeneratorServer
from ralm.drafting import StepOptions
from ralm.step_request import StepRequest


def _calls(server: GeneratorServer, fixture_questions) -> list[tuple]:
    """(doc_id, context, k, ignore_eos, options) of plain steps over different documents and
    contexts, several documents, and a drafted step (which runs on the batcher's thread)."""
    tok = server.tokenizer()
    ctx = [tok(q, add_special_tokens=False)["input_ids"] for q in fixture_questions[:4]]
    return [
        (3, ctx[0], 8, False, None),
        (7, ctx[1], 8, True, None),
        (None, ctx[2], 6, True, None),
        (11, ctx[3], 8, False, None),
        (3, ctx[1] + ctx[0][:3], 8, True, None),
        ((5, 9), ctx[2], 6, True, StepOptions(num_docs=2)),
        (12, ctx[0], 8, True, StepOptions(drafting="ngram")),
        (20, ctx[3], 5, True, None),
    ]


def _request(doc_id, context, k, ignore_eos=False, options=None) -> StepRequest:
    return StepRequest(tuple(context), k, doc_ids=doc_id, ignore_eos=ignore_eos, options=options)


@pytest.fixture(scope="module")
def server(gen_model_dir, fixture_corpus) -> GeneratorServer:
    return GeneratorServer({"model": gen_model_dir}, fixture_corpus.path)


def test_concurrent_steps_are_batched_and_each_equals_the_step_alone(server, local_generator, fixture_questions):
    calls = _calls(server, fixture_questions)
    # the reference: each step alone on another engine (its own KV sessions)
    alone = [local_generator.step(d, c, k, ignore_eos=e, options=o) for d, c, k, e, o in calls]
    batcher = server.engine.batcher
    assert batcher is not None

    async def together():
        # hold the model's thread until every step has been submitted, so that they all
        # arrive between the same two iterations
        gate = threading.Event()
        held = asyncio.wrap_future(batcher.call(gate.wait))
        tasks = [asyncio.ensure_future(server.step(_request(*c))) for c in calls]
        await asyncio.sleep(0.05)
        gate.set()
        await held
        return await asyncio.gather(*tasks)

    outs = asyncio.run(together())
    for call, a, b in zip(calls, alone, outs):
        assert b.tokens == a.tokens and b.eos == a.eos, call
    info = server.info()
    # batching is on because the whole model passed its invariance proof on this machine
    assert info["invariance_proof"]["ok"] and info["invariant_error"] is None
    assert info["invariance_proof"]["checks"][-1] == f"packed x{server.engine.cfg.batch_max_sequences}"
    m = info["batching"]
    assert m["max_batch"] > 1 and m["iterations"] >= 1
    assert sum(n for b, n in m["batch_size_histogram"].items() if b != "<=1") >= 1
    assert m["steps_done"] == len(calls)  # every step ran in the batch, the n-gram drafted one too
    assert m["sessions"]["takes"] >= len(calls)
    assert server.steps == len(calls)


def test_bad_input_fails_its_own_step_only(server, fixture_questions):
    from ralm.errors import RalmInputError

    tok = server.tokenizer()
    ids = tok(fixture_questions[0], add_special_tokens=False)["input_ids"]

    async def run():
        return await asyncio.gather(
            server.step(_request(3, [], 4)),
            server.step(_request(3, ids, 4)),
            server.step(_request(3, ids * 1000, 4)),
            return_exceptions=True,
        )

    empty, good, too_long = asyncio.run(run())
    assert isinstance(empty, RalmInputError) and "at least one token" in str(empty)
    assert isinstance(too_long, RalmInputError) and "positions" in str(too_long)
    assert not isinstance(good, BaseException) and len(good.tokens) + good.eos >= 1


def test_without_the_batcher_steps_run_one_at_a_time(gen_model_dir, fixture_corpus, fixture_questions):
    plain = GeneratorServer({"model": gen_model_dir, "invariant": False}, fixture_corpus.path)
    assert plain.engine.batcher is None and plain.info()["batching"] is None
    calls = _calls(plain, fixture_questions)[:4]

    async def run():
        alone = [await plain.step(_request(*c)) for c in calls]
        return alone, await asyncio.gather(*(plain.step(_request(*c)) for c in calls))

    alone, together = asyncio.run(run())
    assert [o.tokens for o in together] == [o.tokens for o in alone]
