"""Doc-KV reuse (CICS): the prefix tree over document sequences, exact for n = 1..5."""
from __future__ import annotations

import pytest
import torch

from cache.doc_kv import DocPrefixTree
from ralm.drafting import StepOptions
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
    t.insert((b, c), _seg(800))                  # parent missing: not stored
    assert (b, c) not in t
    assert t.stats.bytes_used == 2400 and t.stats.bytes_reused == 800 * 5


def test_tree_eviction_bounded_and_takes_subtrees():
    t = DocPrefixTree(2500, _size)
    t.insert(((1,),), _seg(800))
    t.insert(((1,), (2,)), _seg(800))
    t.insert(((5,),), _seg(800))
    t.insert(((6,),), _seg(800))                 # over budget: evicts the oldest leaf (1,2)
    assert t.stats.bytes_used <= 2500 and t.stats.evictions >= 1
    assert ((1,), (2,)) not in t
    for i in range(10, 20):
        t.insert(((i,),), _seg(800))
        assert t.stats.bytes_used <= 2500
    for path in list(t._nodes):                  # no orphans: every parent present
        assert len(path) == 1 or path[:-1] in t


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("gpt2", seed=1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_identical_tokens_with_and_without_cache(engine, n):
    ctx = engine.encode_question("how do I copy a tree of files?")
    nocache = type(engine)(engine.model, engine.tokenizer,
                           engine.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    engine.doc_kv.clear()
    docs = DOCS[:n]
    cold = engine.step(docs, ctx, 6)
    assert cold.docs_computed == n and cold.docs_reused == 0 and not cold.doc_kv_hit
    warm = engine.step(docs, ctx, 6)
    assert warm.doc_kv_hit and warm.docs_reused == n and warm.docs_computed == 0
    other = DOCS[:n - 1] + [DOCS[5]]           # same prefix, different last document
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
    engine.doc_kv.clear()
    engine.step(DOCS[:2], ctx, 1)
    two = engine.doc_kv.stats.bytes_used
    small = type(engine)(engine.model, engine.tokenizer,
                         engine.cfg.model_copy(update={"doc_kv_cache_bytes": int(two * 1.2)}))
    for i in range(5):
        small.step([DOCS[i], DOCS[i + 1]], ctx, 1)
        assert small.doc_kv.stats.bytes_used <= int(two * 1.2)
    assert small.doc_kv.stats.evictions >= 1


def test_shifted_reuse_is_opt_in_and_counted(engine):
    ctx = engine.encode_question("what does json do?")
    engine.doc_kv.clear()
    engine.step(DOCS[1], ctx, 2)                 # DOCS[1] alone is cached
    exact = engine.step([DOCS[0], DOCS[1]], ctx, 4)
    assert exact.docs_computed == 2               # default: never reused at another position
    engine.doc_kv.clear()
    engine.step(DOCS[1], ctx, 2)
    inexact = engine.step([DOCS[0], DOCS[1]], ctx, 4, options=StepOptions(allow_inexact_shifted_reuse=True))
    assert inexact.docs_computed == 1 and engine.doc_kv.stats.shifted_reuses == 1
