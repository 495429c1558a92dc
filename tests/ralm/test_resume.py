"""Resuming RaLMSeq/RaLMSpec from a verified prefix (what a replacement coordinator does with a
request checkpoint): the final tokens and documents equal a run from scratch."""

from __future__ import annotations

import pytest

from ralm.config import RequestConfig, SpecConfig
from ralm.results import VerifiedPrefix
from ralm.seq import run_seq
from ralm.spec import run_spec
from tests.factories import ScriptedGenerator, ScriptedKB

Q = "what is the answer to this"  # 6 tokens
K = 4


def scripted(schedule, eos_at=None, max_new=48):
    gen = ScriptedGenerator(eos_at=eos_at)
    gen.encode_question(Q)
    kb = ScriptedKB(schedule=schedule, n_q=6, k=K)
    return gen, kb, RequestConfig(max_new_tokens=max_new, generation_stride=K)


def _prefixes(run, *args, **kw):
    seen = []
    res = run(*args, on_verified=lambda toks, docs, eos: seen.append((list(toks), list(docs), eos)), **kw)
    return res, seen


def test_defaults_unchanged_and_prefixes_are_step_aligned():
    gen, kb, req = scripted({2: 7, 5: 3})
    plain = run_seq(Q, gen, kb, req)
    gen, kb, req = scripted({2: 7, 5: 3})
    res, seen = _prefixes(run_seq, Q, gen, kb, req)
    assert res.tokens == plain.tokens and res.stats.doc_ids == plain.stats.doc_ids
    assert len(seen) == len(plain.stats.doc_ids)
    for toks, docs, _ in seen:
        assert toks == plain.tokens[: len(toks)] and docs == plain.stats.doc_ids[: len(docs)]
        assert len(toks) == K * len(docs)


@pytest.mark.parametrize("spec", [SpecConfig(stride=3), SpecConfig.named("PSA")], ids=["s3", "PSA"])
@pytest.mark.parametrize("method", ["seq", "spec"])
def test_resume_scripted_equals_scratch(method, spec):
    schedule = {2: 7, 5: 3, 9: 1}
    gen, kb, req = scripted(schedule)
    base = run_seq(Q, gen, kb, req)
    gen, kb, req = scripted(schedule)
    _, seen = _prefixes(run_spec, Q, gen, kb, req, spec)  # RaLMSpec's checkpoints (with rollbacks)
    assert seen and all(t == base.tokens[: len(t)] for t, _, _ in seen)
    for toks, docs, eos in [seen[0], seen[len(seen) // 2], seen[-2]]:
        gen, kb, req = scripted(schedule)
        prefix = VerifiedPrefix(toks, docs, eos)
        if method == "seq":
            out = run_seq(Q, gen, kb, req, resume=prefix)
        else:
            out = run_spec(Q, gen, kb, req, spec, resume=prefix)
        assert out.tokens == base.tokens
        assert out.stats.doc_ids == base.stats.doc_ids
        assert out.stats.resumed_tokens == len(toks) > 0
        assert out.stats.steps == len(base.stats.doc_ids)


def test_resume_at_eos_and_complete_prefix():
    gen, kb, req = scripted({}, eos_at=20)
    base, seen = _prefixes(run_seq, Q, gen, kb, req)
    assert base.finish_reason == "stop" and seen[-1][2] is True
    gen, kb, req = scripted({}, eos_at=20)
    out = run_spec(Q, gen, kb, req, SpecConfig(), resume=VerifiedPrefix(*seen[-1]))
    assert out.tokens == base.tokens and out.finish_reason == "stop" and out.stats.kb_calls == 0


def test_resume_rejects_a_prefix_longer_than_the_limit():
    gen, kb, req = scripted({}, max_new=8)
    with pytest.raises(ValueError):
        run_seq(Q, gen, kb, req, resume=VerifiedPrefix([1] * 12, [0, 0, 0]))


def test_resume_real_generator(fixture_generator, retrievers, fixture_questions):
    """The project's generator and a real index: resume from every few checkpoints."""
    req = RequestConfig(max_new_tokens=32, generation_stride=4)
    kb = retrievers["edr"]
    q = fixture_questions[0]
    base, seen = _prefixes(run_seq, q, fixture_generator, kb, req)
    assert len(seen) >= 3
    for toks, docs, eos in seen[1::3]:
        p = VerifiedPrefix(toks, docs, eos)
        assert run_seq(q, fixture_generator, kb, req, resume=p).tokens == base.tokens
        out = run_spec(q, fixture_generator, kb, req, SpecConfig.named("PSA"), resume=p)
        assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
