"""Rollback: a forced speculation error is corrected, and the KV crop continues exactly
as the baseline's uncropped cache does."""

from __future__ import annotations

import numpy as np
import torch

from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.knnlm import KnnEntryCache, KnnStepper, run_knn_seq, run_knn_spec


def _kv(stepper):
    return [(layer.keys.clone(), layer.values.clone()) for layer in stepper.past.layers]


def test_crop_then_feed_is_bit_identical(project_engine):
    lm = project_engine
    ids = lm.encode_question("How do I copy a tree of files?")
    a, b, c, d = 11, 57, 203, 99
    ref = KnnStepper(lm.model)
    ref.prefill(ids)
    ref.feed(a)
    ref.feed(d)
    spec = KnnStepper(lm.model)
    spec.prefill(ids)
    spec.feed(a)
    spec.feed(b)
    spec.feed(c)
    assert spec.length == len(ids) + 3
    spec.crop(len(ids) + 1)  # drop b and c
    assert spec.past.get_seq_length() == len(ids) + 1
    spec.feed(d)
    assert np.array_equal(spec.h, ref.h) and np.array_equal(spec.p_lm, ref.p_lm)
    for (k1, v1), (k2, v2) in zip(_kv(spec), _kv(ref)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


class PoisonedCache(KnnEntryCache):
    """Returns a wrong neighbour on chosen lookups: one entry whose value differs from the
    KB's best entry, so with k=1 and lambda=1 the speculated token must be wrong."""

    def __init__(self, kb, bad_lookups, **kw):
        super().__init__(kb.ds, **kw)
        self.kb, self.bad, self.lookups = kb, set(bad_lookups), 0

    def search(self, query, k):
        self.lookups += 1
        if self.lookups not in self.bad:
            return super().search(query, k)
        truth = self.kb.search(query, 1)[0][0]
        wrong = int(np.flatnonzero(self.ds.values != self.ds.values[truth])[0])
        return [(wrong, 0.0)]


def test_forced_mismatch_rolls_back_and_matches(knn_setups, knn_prompts):
    lm, ds, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["flat"]
    knn = KnnLMConfig(k=1, lmbda=1.0)
    req = RequestConfig(max_new_tokens=20, ignore_eos=True)
    for prompt in knn_prompts[:2]:
        base = run_knn_seq(prompt, lm, kb, knn, req)
        cache = PoisonedCache(kb, bad_lookups={2, 7, 8}, capacity=4096)
        got = run_knn_spec(prompt, lm, kb, knn, req, SpecConfig(stride=4), cache=cache)
        assert got.tokens == base.tokens
        st = got.stats
        assert st.rollbacks >= 2 and st.regenerated_tokens > 0
        assert st.steps == len(got.tokens) == 20


def test_mismatch_at_last_token_and_at_window_start(knn_setups, knn_prompts):
    """Errors at every position of a window, including the request's last token."""
    lm, ds, kbs = knn_setups["tiny-gpt2"]
    kb = kbs["hnsw"]
    knn = KnnLMConfig(k=1, lmbda=1.0)
    req = RequestConfig(max_new_tokens=12, ignore_eos=True)
    base = run_knn_seq(knn_prompts[0], lm, kb, knn, req)
    for bad in ({1}, {3}, {1, 2, 3, 4, 5}, set(range(1, 40))):
        got = run_knn_spec(
            knn_prompts[0], lm, kb, knn, req, SpecConfig(stride=3), cache=PoisonedCache(kb, bad, capacity=4096)
        )
        assert got.tokens == base.tokens, bad
    # every speculative step wrong: each window commits exactly one (corrected) token
    assert got.stats.matched_steps == 0 and got.stats.rollbacks == got.stats.verifications


def test_a_batched_request_keeps_its_kv_in_the_engines_pool_and_gives_it_back(knn_setups, knn_prompts):
    """On an engine with a batcher, the request's sequence is paged in the engine's pool (its
    feeds join the pooled steps' one KV write per layer), and every block goes back when the
    request ends, rollbacks included."""
    from ralm.knnlm import BatchedKnnStepper, stepper_for

    lm, _, kbs = knn_setups["tiny-gpt2"]
    pool = lm.kv_pool
    assert lm.batcher is not None and pool is not None
    step = stepper_for(lm)
    assert isinstance(step, BatchedKnnStepper) and step.kv.pool is pool
    before = pool.stats()["blocks_used"]
    step.prefill(lm.encode_question(knn_prompts[0]) * 30)  # more than one block
    assert pool.stats()["blocks_used"] >= before + 2
    step.close()
    assert pool.stats()["blocks_used"] == before
    knn = KnnLMConfig(k=4)
    req = RequestConfig(max_new_tokens=12, ignore_eos=True)
    seq = run_knn_seq(knn_prompts[1], lm, kbs["flat"], knn, req)
    spec = run_knn_spec(knn_prompts[1], lm, kbs["flat"], knn, req, SpecConfig(stride=4))
    assert spec.tokens == seq.tokens
    assert pool.stats()["blocks_used"] == before
