"""n-gram (IGPG) and dense (DReSD) drafting: same tokens as plain greedy up to float near-ties."""

from __future__ import annotations

import pytest

from ralm import constants as C
from ralm.config import RequestConfig
from ralm.drafting import StepOptions
from ralm.drafting.dense import DenseDrafter, build_datastore, collect_sequences
from ralm.drafting.exactness import first_divergence, first_index
from ralm.drafting.idgr import idgr_block
from ralm.drafting.ngram import NGramDrafter
from ralm.engine import LMEngine
from tests.factories import tiny_engine

K = 24


def assert_exact_or_near_tie(engine, docs, ctx, plain, other, ignore_eos=True):
    div = first_divergence(engine, docs, ctx, plain, other, ignore_eos)
    assert div is None or div.near_tie(C.DIVERGENCE_GAP), div


def test_ngram_drafter_copies_from_doc_then_context():
    d = NGramDrafter([[1, 2, 3, 4, 5, 6, 7, 8]], n=3, m=3, min_n=2)
    assert d.propose([9, 2, 3, 4]) == [[5, 6, 7]]
    assert d.propose([9, 9, 3, 4]) == [[5, 6, 7]]  # backs off to a 2-gram
    assert d.propose([20, 21, 22, 20, 21]) == [[22, 20, 21]]  # from the context itself
    assert d.propose([30, 31]) == []
    assert d.propose([2, 3, 4], m=1) == [[5]]


def test_first_divergence_helper():
    assert first_index([1, 2, 3], [1, 2, 3]) is None
    assert first_index([1, 2, 3], [1, 5, 3]) == 1
    assert first_index([1, 2], [1, 2, 3]) == 2


@pytest.fixture(scope="module")
def eng(project_engine):
    return LMEngine(project_engine.model, project_engine.tokenizer, project_engine.cfg)


@pytest.fixture(scope="module")
def prompts(eng, fixture_corpus, fixture_questions):
    return [
        ([fixture_corpus.text(i), fixture_corpus.text(i + 7)][:n], eng.encode_question(q))
        for i, (q, n) in enumerate(zip(fixture_questions[:4], (1, 3, 1, 2)))
    ]


def test_ngram_matches_plain_with_fewer_forwards(eng, prompts):
    fp_plain = fp_ngram = 0
    for docs, ctx in prompts:
        plain = eng.step(docs, ctx, K, ignore_eos=True)
        ng = eng.step(docs, ctx, K, ignore_eos=True, options=StepOptions(drafting="ngram"))
        assert len(ng.tokens) == K
        assert_exact_or_near_tie(eng, docs, ctx, plain.tokens, ng.tokens)
        fp_plain += plain.forward_passes
        fp_ngram += ng.forward_passes
        assert ng.accepted_tokens <= ng.drafted_tokens
    assert fp_ngram < fp_plain


def test_dense_in_distribution(eng, prompts):
    # datastore from the model's own greedy generations on these prompts
    ex = []
    for docs, ctx in prompts:
        gen = eng.step(docs, ctx, K + 8, ignore_eos=True).tokens
        ex.append((docs, list(ctx) + gen, len(ctx), len(ctx) + len(gen)))
    keys, vals = collect_sequences(eng, ex)
    store = build_datastore(keys, vals, pca_dim=32)
    assert len(store) == len(keys) and store.components.shape[0] == 32
    eng.attach_dense_datastore(store)
    acc = 0
    for docs, ctx in prompts:
        plain = eng.step(docs, ctx, K, ignore_eos=True)
        de = eng.step(docs, ctx, K, ignore_eos=True, options=StepOptions(drafting="dense"))
        assert len(de.tokens) == K
        assert_exact_or_near_tie(eng, docs, ctx, plain.tokens, de.tokens)
        acc += de.accepted_tokens
        assert de.forward_passes <= plain.forward_passes
    assert acc > 0
    # drafts are filtered on the model's next token
    h = None
    assert DenseDrafter(store).propose([], h, 5) == []


@pytest.mark.parametrize("drafting", ["ngram", "dense"])
def test_eos_and_k_limit_with_drafting(drafting):
    engine = tiny_engine("gpt2", seed=3)
    ctx = engine.encode_question("what does json do?")
    doc = "json.dumps\nSerialize obj to a JSON formatted str using this conversion table."
    if drafting == "dense":
        gen = engine.step(doc, ctx, 20, ignore_eos=True).tokens
        engine.attach_dense_datastore(
            build_datastore(
                *collect_sequences(engine, [([doc], list(ctx) + gen, len(ctx), len(ctx) + len(gen))]), pca_dim=16
            )
        )
    opts = StepOptions(drafting=drafting)
    for k in (1, 2, 5, 9):
        plain = engine.step(doc, ctx, k)
        d = engine.step(doc, ctx, k, options=opts)
        assert len(d.tokens) <= k and d.tokens == plain.tokens and d.eos == plain.eos
    free = engine.step(doc, ctx, 8)
    engine.eos_token_id = free.tokens[3]
    first = free.tokens.index(free.tokens[3])
    stopped = engine.step(doc, ctx, 8, options=opts)
    assert stopped.eos and stopped.tokens == free.tokens[:first]
    forced = engine.step(doc, ctx, 8, ignore_eos=True, options=opts)
    assert not forced.eos and len(forced.tokens) == 8 and engine.eos_token_id not in forced.tokens


def test_flare_step_is_a_prefix_of_plain(eng, prompts):
    docs, ctx = prompts[0]
    plain = eng.step(docs, ctx, K)
    f = eng.step(docs, ctx, K, options=StepOptions(flare_threshold=0.5))
    assert 1 <= len(f.tokens) <= K and f.tokens == plain.tokens[: len(f.tokens)]
    assert f.low_confidence or len(f.tokens) == len(plain.tokens)


def test_idgr_block_is_opt_in_and_rank_based():
    b = idgr_block([5, 9], [1])
    assert "[5] (relevance rank 1)" in b and "Unrelated documents: [1]" in b
    # IDGR changes outputs: a request that does not ask for it never gets it
    assert StepOptions.from_request(RequestConfig()).idgr is False
