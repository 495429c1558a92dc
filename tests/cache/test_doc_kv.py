"""Doc-KV reuse (CICS): the prefix tree over document sequences, exact for n = 1..5."""

from __future__ import annotations

import pytest
import torch

from cache.doc_kv import DocPrefixTree
from ralm.drafting import StepOptions
from ralm.hf_cache import cache_kwargs
from tests.factories import tiny_engine

DOCS = [
    "json.dumps\nSerialize obj to a JSON formatted str using this conversion table.",
    "shutil.copytree\nRecursively copy an entire directory tree rooted at src.",
    "sorted\nReturn a new list containing all items from the iterable in ascending order.",
    "what does the json module do? Serialize obj to a JSON formatted str.",
    "Recursively copy a tree of files; return a new list in ascending order.",
    "copy the iterable, then serialize the list to JSON using the table.",
]


def _seg(nbytes: int):
    return [(torch.zeros(nbytes // 8, dtype=torch.float32), torch.zeros(nbytes // 8, dtype=torch.float32))]


def _size(seg):
    return sum(k.numel() * 4 + v.numel() * 4 for k, v in seg)


def test_tree_longest_prefix_and_stats():
    t = DocPrefixTree(10_000, _size)
    a, b, c, d = (1,), (2,), (3,), (4,)
    t.insert((a,), _seg(800))
    t.insert((a, b), _seg(800))
    t.insert((a, b, c), _seg(800))
    assert len(t.lookup((a, b, d))) == 2 and t.stats.prefix_hits == 1
    assert len(t.lookup((a, b, c))) == 3 and t.stats.full_hits == 1
    assert t.lookup((b, a)) == [] and t.stats.misses == 1 + 2
    t.insert((b, c), _seg(800))  # parent missing: not stored
    assert (b, c) not in t
    assert t.stats.bytes_used == 2400 and t.stats.bytes_reused == 800 * 5


def test_tree_eviction_bounded_and_takes_subtrees():
    t = DocPrefixTree(2500, _size)
    t.insert(((1,),), _seg(800))
    t.insert(((1,), (2,)), _seg(800))
    t.insert(((5,),), _seg(800))
    t.insert(((6,),), _seg(800))  # over budget: evicts the oldest leaf (1,2)
    assert t.stats.bytes_used <= 2500 and t.stats.evictions >= 1
    assert ((1,), (2,)) not in t
    for i in range(10, 20):
        t.insert(((i,),), _seg(800))
        assert t.stats.bytes_used <= 2500
    for path in list(t._nodes):  # no orphans: every parent present
        assert len(path) == 1 or path[:-1] in t


@pytest.fixture(scope="module")
def engine():
    # KV sessions off: every step asks the doc-KV tree (with sessions, a step that continues
    # a request's session needs no document KV at all); the KV pool off: with it, batched
    # steps keep the documents' KV in the pool's doc-block cache, and only steps run one at a
    # time use the tree (tests/ralm/batching/test_kv_pool.py)
    return tiny_engine("gpt2", seed=1, kv_session_bytes=0, kv_pool=False)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_identical_tokens_with_and_without_cache(engine, n):
    ctx = engine.encode_question("how do I copy a tree of files?")
    nocache = type(engine)(engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    engine.clear_kv_caches()
    docs = DOCS[:n]
    cold = engine.step(docs, ctx, 6)
    assert cold.docs_computed == n and cold.docs_reused == 0 and not cold.doc_kv_hit
    warm = engine.step(docs, ctx, 6)
    assert warm.doc_kv_hit and warm.docs_reused == n and warm.docs_computed == 0
    other = DOCS[: n - 1] + [DOCS[5]]  # same prefix, different last document
    part = engine.step(other, ctx, 6)
    assert part.docs_reused == n - 1 and part.docs_computed == 1
    again = engine.step(other, ctx, 6)
    fresh = nocache.step(docs, ctx, 6)
    fresh_other = nocache.step(other, ctx, 6)
    assert cold.tokens == warm.tokens == fresh.tokens
    assert part.tokens == again.tokens == fresh_other.tokens


def test_single_doc_api_unchanged(engine):
    ctx = engine.encode_question("what does json do?")
    assert engine.step(DOCS[0], ctx, 5).tokens == engine.step([DOCS[0]], ctx, 5).tokens


def test_eviction_bounded_in_bytes_through_engine(engine):
    ctx = engine.encode_question("what does json do?")
    engine.clear_kv_caches()
    engine.step(DOCS[:2], ctx, 1)
    two = engine.doc_kv.stats.bytes_used
    small = type(engine)(
        engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": int(two * 1.2)})
    )
    for i in range(5):
        small.step([DOCS[i], DOCS[i + 1]], ctx, 1)
        assert small.doc_kv.stats.bytes_used <= int(two * 1.2)
    assert small.doc_kv.stats.evictions >= 1


def test_shifted_reuse_is_opt_in_and_counted(engine):
    ctx = engine.encode_question("what does json do?")
    engine.clear_kv_caches()
    engine.step(DOCS[1], ctx, 2)  # DOCS[1] alone is cached
    exact = engine.step([DOCS[0], DOCS[1]], ctx, 4)
    assert exact.docs_computed == 2  # default: never reused at another position
    engine.clear_kv_caches()
    engine.step(DOCS[1], ctx, 2)
    inexact = engine.step([DOCS[0], DOCS[1]], ctx, 4, options=StepOptions(allow_inexact_shifted_reuse=True))
    assert inexact.docs_computed == 1 and engine.doc_kv.stats.shifted_reuses == 1


# ------------------------------------------------------------- no copies, never written
def _clones(seg):
    return [(k.clone(), v.clone(), k.data_ptr(), v.data_ptr()) for k, v in seg]


def _unchanged(tree, snap):
    checked = 0
    for path, seg in snap.items():
        if path not in tree:
            continue
        for (k, v), (k0, v0, pk, pv) in zip(tree._nodes[path][0], seg):
            assert k.data_ptr() == pk and v.data_ptr() == pv  # the same storage ...
            assert torch.equal(k, k0) and torch.equal(v, v0)  # ... never written into
        checked += 1
    return checked


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_stored_segments_are_shared_and_never_written(family):
    """A hit hands the stored tensors to the model without copying them, and nothing -- the
    context prefill right after a miss stored them, later hits, n-gram drafting, FLARE,
    several documents, a crop -- ever writes into them (compared with their value when
    they were inserted)."""
    from ralm.doc_kv import docs_past

    eng = tiny_engine(family, seed=2, kv_pool=False)  # the batched steps' documents come from the tree
    at_insert: dict = {}
    insert = eng.doc_kv.insert

    def recording_insert(docs, seg):
        at_insert[tuple(docs)] = _clones(seg)
        insert(docs, seg)

    eng.doc_kv.insert = recording_insert
    ctx = eng.encode_question("how do I copy a tree of files?")
    for opts in (None, StepOptions(drafting="ngram", ngram_n=1, ngram_min_n=1), StepOptions(flare_threshold=0.5)):
        for docs in (DOCS[3], DOCS[:3], DOCS[:2], [DOCS[0], DOCS[1], DOCS[5]], DOCS[3]):
            for c in (ctx, ctx + [5, 6, 7]):
                eng.step(docs, c, 6, ignore_eos=True, options=opts)
                assert _unchanged(eng.doc_kv, at_insert) == len(eng.doc_kv)
    assert len(at_insert) == 5  # (d3), (d0), (d0 d1), (d0 d1 d2), (d0 d1 d5)
    past, info = docs_past(eng, [eng.doc_tokens(DOCS[3])])
    assert info.hit
    assert past.layers[0].keys is eng.doc_kv._nodes[(eng.doc_tokens(DOCS[3]),)][0][0][0]  # no copy
    past, _ = docs_past(eng, [eng.doc_tokens(d) for d in DOCS[:3]])
    past.crop(-3)  # crop before any update
    assert past.get_seq_length() == sum(len(eng.doc_tokens(d)) for d in DOCS[:3]) - 3
    assert _unchanged(eng.doc_kv, at_insert) == 5


@pytest.mark.parametrize("n", [1, 3])
def test_reused_kv_and_logits_are_bit_identical(engine, n):
    """Not just the tokens: the KV (hit, prefix hit, miss, no cache) and the logits on top
    of it are the same bits."""
    from ralm.doc_kv import docs_past

    nocache = type(engine)(engine.model, engine.tokenizer, engine.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    docs = [engine.doc_tokens(d) for d in DOCS[:n]]
    ids = torch.tensor([engine.encode_question("what does json do?")])

    def kv_and_logits(eng):
        past, info = docs_past(eng, docs)
        pre = [(layer.keys.clone(), layer.values.clone()) for layer in past.layers]
        with torch.inference_mode():
            logits = eng.model(input_ids=ids, use_cache=True, **cache_kwargs(eng.model, past)).logits
        return pre, logits, info

    engine.clear_kv_caches()
    ref_kv, ref_logits, _ = kv_and_logits(nocache)
    for expect_hit in (False, True):
        kv, logits, info = kv_and_logits(engine)
        assert info.hit == expect_hit
        assert torch.equal(logits, ref_logits)
        for (k, v), (k0, v0) in zip(kv, ref_kv):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    if n > 1:  # a prefix hit, the last doc computed
        engine.clear_kv_caches()
        docs_past(engine, docs[:-1])
        kv, logits, info = kv_and_logits(engine)
        assert info.docs_reused == n - 1 and info.docs_computed == 1
        assert torch.equal(logits, ref_logits)


def test_segments_layer_reads_and_lengths():
    from ralm.doc_kv import cache_from_segments

    a = [(torch.arange(24.0).view(1, 2, 3, 4), -torch.arange(24.0).view(1, 2, 3, 4))]
    b = [(torch.ones(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))]
    cache = cache_from_segments([a, b])
    assert cache.get_seq_length() == 5
    layer = cache.layers[0]
    assert torch.equal(layer.keys, torch.cat([a[0][0], b[0][0]], dim=-2))  # read: concatenated
    k, v = cache.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0), 0)
    assert k.shape[-2] == 6 and torch.equal(k[..., :3, :], a[0][0]) and float(v[0, 0, -1, 0]) == 8.0
    cache = cache_from_segments([a, b])
    k, v = cache.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0), 0)  # update first
    assert k.shape[-2] == 6 and torch.equal(k[..., 3:5, :], b[0][0]) and torch.equal(v[..., :3, :], a[0][1])
    assert torch.equal(a[0][0], torch.arange(24.0).view(1, 2, 3, 4))  # untouched
