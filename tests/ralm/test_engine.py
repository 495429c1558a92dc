"""The deterministic step f(doc, context, k) on tiny GPT-2, OPT and Llama models."""

from __future__ import annotations

import pytest
import torch

from ralm.errors import RalmInputError
from ralm.hf_cache import cache_kwargs, cache_of
from tests.factories import tiny_engine

DOCS = [
    "json.dumps\nSerialize obj to a JSON formatted str using this conversion table.",
    "shutil.copytree\nRecursively copy an entire directory tree rooted at src.",
    "sorted\nReturn a new list containing all items from the iterable in ascending order.",
]


@pytest.fixture(scope="module", params=["gpt2", "opt", "llama"])
def engine(request):
    return tiny_engine(request.param)


def test_step_returns_k_tokens(engine):
    ctx = engine.encode_question("what does json do?")
    out = engine.step(DOCS[0], ctx, 5)
    assert len(out.tokens) == 5 or out.eos
    assert all(isinstance(t, int) for t in out.tokens)


def test_identical_with_and_without_doc_kv_cache_and_after_other_calls(engine):
    ctx = engine.encode_question("how do I copy a tree of files?")
    engine.clear_kv_caches()
    cold = engine.step(DOCS[1], ctx, 8)
    assert not cold.doc_kv_hit
    # arbitrary other calls in between, which also fill and touch the cache
    for d in DOCS:
        engine.step(d, ctx + cold.tokens[:3], 3)
    warm = engine.step(DOCS[1], ctx, 8)
    assert warm.doc_kv_hit
    # a second engine with the cache disabled (same weights)
    nocache = type(engine)(engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    fresh = nocache.step(DOCS[1], ctx, 8)
    assert cold.tokens == warm.tokens == fresh.tokens
    assert not fresh.doc_kv_hit


def test_step_equals_plain_greedy_reference(engine):
    """f must agree with a straightforward reference computed without any caching:
    doc KV from the doc alone, then the context, then greedy decode."""
    ctx = engine.encode_question("what does sorted return?")
    doc = list(engine.doc_tokens(DOCS[2]))
    out = engine.step(DOCS[2], ctx, 6)
    with torch.inference_mode():
        m = engine.model
        past = cache_of(m(input_ids=torch.tensor([doc]), use_cache=True))
        # the step asks for the last position's logits only (as HF generate's prefill does)
        o = m(input_ids=torch.tensor([ctx]), use_cache=True, logits_to_keep=1, **cache_kwargs(m, past))
        ref = []
        for _ in range(6):
            t = int(torch.argmax(o.logits[0, -1]))
            if t == engine.eos_token_id:
                break
            ref.append(t)
            o = m(input_ids=torch.tensor([[t]]), use_cache=True, **cache_kwargs(m, cache_of(o)))
    assert out.tokens == ref


def test_eos_ends_the_step():
    engine = tiny_engine("gpt2", seed=3)
    ctx = engine.encode_question("what does json do?")
    free = engine.step(DOCS[0], ctx, 6)
    assert len(free.tokens) == 6
    # declare the 3rd generated token to be EOS: the step must stop right before it
    engine.eos_token_id = free.tokens[2]
    first = free.tokens.index(free.tokens[2])
    stopped = engine.step(DOCS[0], ctx, 6)
    assert stopped.eos and stopped.tokens == free.tokens[:first]
    # ignore_eos masks it: k tokens, none of them EOS
    forced = engine.step(DOCS[0], ctx, 6, ignore_eos=True)
    assert not forced.eos and len(forced.tokens) == 6 and engine.eos_token_id not in forced.tokens


def test_doc_truncated_to_max_doc_tokens():
    engine = tiny_engine("gpt2", max_doc_tokens=7)
    long_doc = " ".join(["recursively copy an entire directory tree"] * 20)
    assert len(engine.doc_tokens(long_doc)) == 7


@pytest.mark.parametrize("bad,msg", [("", "empty"), ("   ", "empty"), (42, "must be a string")])
def test_bad_questions(bad, msg):
    engine = tiny_engine("gpt2")
    with pytest.raises(RalmInputError, match=msg):
        engine.encode_question(bad)


def test_over_long_question_rejected():
    engine = tiny_engine("gpt2", max_prompt_tokens=16)
    with pytest.raises(RalmInputError, match="limit is 16 tokens"):
        engine.encode_question("copy the tree " * 40)


def test_context_beyond_model_positions_rejected():
    engine = tiny_engine("gpt2")
    with pytest.raises(RalmInputError, match="exceed"):
        engine.step(DOCS[0], [5] * 1020, 8)


@pytest.mark.parametrize("kv_pool", [True, False])
def test_doc_kv_cache_is_bounded_in_bytes(kv_pool):
    """The documents' KV lives in one cache, bounded by ``doc_kv_cache_bytes``: the pool's
    doc-block cache with the pool on (the prefix tree then holds nothing), the prefix tree
    without it."""
    base = tiny_engine("gpt2")
    engine = type(base)(base.model, base.tokenizer, base.cfg.model_copy(update={"kv_pool": kv_pool}))

    def cache(e):
        return e.doc_blocks if kv_pool else e.doc_kv

    ctx = engine.encode_question("what does json do?")
    engine.step(DOCS[0], ctx, 1)
    one = cache(engine).stats.bytes_used
    assert one > 0
    if kv_pool:
        assert engine.doc_kv.stats.bytes_used == 0
    small = type(engine)(
        engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": int(one * 1.5)})
    )
    for d in DOCS:
        small.step(d, ctx, 1)
    assert 0 < cache(small).stats.bytes_used <= int(one * 1.5)
    assert cache(small).stats.evictions >= 1
