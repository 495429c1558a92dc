"""The exactness contract on real parts: RaLMSpec tokens == RaLMSeq tokens.

Real FAISS (flat, HNSW) and Lucene BM25 indexes over the fixture corpus, at least 20
questions, every configuration {base, P, S, A, PS, PA, SA, PSA} and fixed strides {1, 3, 8}.
(With S the stride is chosen by OS3, so the fixed stride only applies to the configurations
without S.) The matrix runs on a tiny random GPT-2 with the project's tokenizer on the
default engine (``tiny_generator``): the contract holds for any generator, and its drifting
text changes the retrieved documents often (checked below); the EOS requests run on the
project's own generator, whose stops are real.
"""

from __future__ import annotations

import pytest

from ralm.config import RequestConfig, SpecConfig
from ralm.seq import run_seq
from ralm.spec import run_spec

# every retriever x configuration: `make test` runs it; `make test-fast` leaves it out
pytestmark = pytest.mark.matrix

KINDS = ["edr", "adr", "sr"]
CONFIGS = [(n, s) for n in ["base", "P", "A", "PA"] for s in (1, 3, 8)] + [(n, None) for n in ["S", "PS", "SA", "PSA"]]
# Fixed-length generation (EOS masked) so every request has 10 retrieval steps; the EOS
# paths are covered by tests/ralm/test_spec_loop.py and test_eos_requests below.
REQ = RequestConfig(max_new_tokens=40, generation_stride=4, ignore_eos=True)
REQ_EOS = RequestConfig(max_new_tokens=40, generation_stride=4)


@pytest.fixture(scope="module")
def questions(fixture_questions):
    assert len(fixture_questions) >= 20
    return fixture_questions[:20]


@pytest.fixture(scope="module")
def baselines(retrievers, tiny_generator, questions):
    return {kind: [run_seq(q, tiny_generator, retrievers[kind], REQ) for q in questions] for kind in KINDS}


def test_baselines_use_several_documents(baselines):
    # the workload must exercise speculation: documents change during generation
    changes = sum(len(set(r.stats.doc_ids)) > 1 for rs in baselines.values() for r in rs)
    assert changes >= 10


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,stride", CONFIGS, ids=[f"{n}-s{s}" if s else n for n, s in CONFIGS])
def test_spec_equals_seq(kind, name, stride, retrievers, tiny_generator, questions, baselines):
    spec = SpecConfig.named(name, **({"stride": stride} if stride else {}))
    mismatched = []
    kb_calls = spec_calls = rollbacks = 0
    for q, base in zip(questions, baselines[kind]):
        out = run_spec(q, tiny_generator, retrievers[kind], REQ, spec)
        if out.tokens != base.tokens or out.stats.doc_ids != base.stats.doc_ids:
            mismatched.append(q)
        kb_calls += base.stats.kb_calls
        spec_calls += out.stats.kb_calls
        rollbacks += out.stats.rollbacks
    assert not mismatched, f"{len(mismatched)} outputs differ, e.g. {mismatched[0]!r}"
    if stride and stride > 1:
        # with a fixed stride > 1 speculation must actually save KB calls on this workload,
        # and some speculations must fail: both outcomes of a verification are exercised
        assert spec_calls < kb_calls and rollbacks > 0


@pytest.mark.parametrize("kind", KINDS)
def test_eos_requests(kind, retrievers, fixture_generator, questions):
    """With EOS allowed (the model often stops early), outputs are still identical."""
    spec = SpecConfig.named("PSA")
    for q in questions[:8]:
        base = run_seq(q, fixture_generator, retrievers[kind], REQ_EOS)
        out = run_spec(q, fixture_generator, retrievers[kind], REQ_EOS, spec)
        assert out.tokens == base.tokens and out.finish_reason == base.finish_reason


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_requests_through_the_batcher_equal_seq_alone(
    kind, retrievers, tiny_generator, questions, baselines
):
    """Continuous batching on: 20 requests at once (RaLMSeq, PSA, P with stride 3 mixed)
    share the generator's batched forwards and KV sessions; each returns the tokens
    RaLMSeq returned for it alone, one request at a time."""
    from concurrent.futures import ThreadPoolExecutor

    batcher = tiny_generator.engine.batcher
    assert batcher is not None  # the default engine batches

    def shared() -> int:  # iterations that held more than one sequence
        return sum(n for size, n in batcher.batch_hist.items() if size > 1)

    before = shared()
    specs = [None, SpecConfig.named("PSA"), SpecConfig.named("P", stride=3)]

    def one(i):
        q, spec = questions[i], specs[i % len(specs)]
        if spec is None:
            return run_seq(q, tiny_generator, retrievers[kind], REQ)
        return run_spec(q, tiny_generator, retrievers[kind], REQ, spec)

    with ThreadPoolExecutor(10) as pool:
        outs = list(pool.map(one, range(len(questions))))
    for out, base in zip(outs, baselines[kind]):
        assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids
    assert shared() > before  # requests really shared forward passes
