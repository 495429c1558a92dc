"""run_knn_spec == run_knn_seq, token for token: two real LMs (a tiny random GPT-2 and the
project's pydocs-gpt), exact (padded flat) and approximate (HNSW) datastores, k from 1 to
1024, a fixed stride and OS3, five prompts each."""

from __future__ import annotations

import pytest

from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.knnlm import run_knn_seq, run_knn_spec

# every retriever x configuration: `make test` runs it; `make test-fast` leaves it out
pytestmark = pytest.mark.matrix

MAX_NEW = {"tiny-gpt2": 16, "pydocs-gpt": 24}
# lambda: the kNN distribution must be able to change the LM's choice, or the cache's
# guesses would always be right and rollbacks never exercised
LAMBDA = {"tiny-gpt2": 0.9, "pydocs-gpt": 0.5}
SPECS = {"s=3": SpecConfig(stride=3), "OS3": SpecConfig(adaptive_stride=True)}
ROLLBACKS: dict = {}


@pytest.mark.parametrize("k", [1, 16, 256, 1024])
@pytest.mark.parametrize("index", ["flat", "hnsw"])
@pytest.mark.parametrize("model", ["tiny-gpt2", "pydocs-gpt"])
def test_spec_equals_seq(knn_setups, knn_prompts, model, index, k):
    _check_spec_equals_seq(knn_setups, knn_prompts, model, index, k)


def _check_spec_equals_seq(knn_setups, knn_prompts, model, index, k):
    lm, ds, kbs = knn_setups[model]
    kb = kbs[index]
    knn = KnnLMConfig(k=k, lmbda=LAMBDA[model], index=index)
    req = RequestConfig(max_new_tokens=MAX_NEW[model], ignore_eos=True)
    for prompt in knn_prompts:
        base = run_knn_seq(prompt, lm, kb, knn, req)
        assert len(base.tokens) == MAX_NEW[model]
        assert base.stats.kb_calls == MAX_NEW[model]
        for name, spec in SPECS.items():
            got = run_knn_spec(prompt, lm, kb, knn, req, spec)
            assert got.tokens == base.tokens, (model, index, k, name, prompt)
            st = got.stats
            assert st.steps == len(got.tokens)
            assert st.matched_steps + st.rollbacks + st.direct_steps + 1 == st.steps
            assert st.kb_calls == 1 + st.verifications + st.direct_steps
            assert sum(st.strides) == st.spec_steps
            assert st.knn_k == k
            # the cache is filled when first used: never, when every step was direct and unprobed
            assert st.cache_entries > 0 or (st.spec_steps == 0 and st.cache_lookups == 0)
            ROLLBACKS[(model, index, k, name)] = ROLLBACKS.get((model, index, k, name), 0) + st.rollbacks


def test_rollbacks_were_exercised(knn_setups, knn_prompts):
    """The matrix above is only meaningful if speculation went wrong sometimes."""
    for model in MAX_NEW:
        # run alone (e.g. with -k), or in a worker that got only some of the matrix (pytest -n):
        # the exact flat index at k = 16, where each model is known to roll back, if not run here
        ran_flat16 = any(key[:3] == (model, "flat", 16) for key in ROLLBACKS)
        if not ran_flat16 and not any(n for key, n in ROLLBACKS.items() if key[0] == model):
            _check_spec_equals_seq(knn_setups, knn_prompts, model, "flat", 16)
    per_model = {}
    for (model, *_), n in ROLLBACKS.items():
        per_model[model] = per_model.get(model, 0) + n
    assert all(n > 0 for n in per_model.values()), per_model


def test_eos_stops_both_loops_alike(knn_setups, knn_prompts):
    lm, ds, kbs = knn_setups["pydocs-gpt"]
    knn = KnnLMConfig(k=16, lmbda=0.5)
    req = RequestConfig(max_new_tokens=40)
    for prompt in knn_prompts[:2]:
        base = run_knn_seq(prompt, lm, kbs["flat"], knn, req)
        got = run_knn_spec(prompt, lm, kbs["flat"], knn, req, SpecConfig(stride=4))
        assert got.tokens == base.tokens and got.finish_reason == base.finish_reason


def test_streaming_commits_only_verified_tokens(knn_setups, knn_prompts):
    lm, ds, kbs = knn_setups["tiny-gpt2"]
    knn = KnnLMConfig(k=16, lmbda=0.9)
    req = RequestConfig(max_new_tokens=16, ignore_eos=True)
    chunks: list[list[int]] = []
    got = run_knn_spec(knn_prompts[0], lm, kbs["flat"], knn, req, SpecConfig(stride=4), on_commit=chunks.append)
    assert [t for c in chunks for t in c] == got.tokens == run_knn_seq(knn_prompts[0], lm, kbs["flat"], knn, req).tokens


def test_async_is_rejected(knn_setups, knn_prompts):
    from ralm.errors import RalmInputError

    lm, ds, kbs = knn_setups["tiny-gpt2"]
    with pytest.raises(RalmInputError, match="asynchronous"):
        run_knn_spec(
            knn_prompts[0],
            lm,
            kbs["flat"],
            KnnLMConfig(),
            RequestConfig(max_new_tokens=4),
            SpecConfig(async_verify=True),
        )


@pytest.mark.parametrize("k", [1, 16])
@pytest.mark.parametrize("index", ["flat", "hnsw"])
def test_prefetch_spec_equals_seq(knn_setups, knn_prompts, index, k):
    """P (prefetching): the KB's top-p (p > k) goes into the cache; tokens still equal the
    baseline's (flat: the top-k is the prefix of the top-p; HNSW: asked separately)."""
    lm, ds, kbs = knn_setups["pydocs-gpt"]
    kb = kbs[index]
    knn = KnnLMConfig(k=k, lmbda=LAMBDA["pydocs-gpt"], index=index, prefetch_size=64)
    req = RequestConfig(max_new_tokens=MAX_NEW["pydocs-gpt"], ignore_eos=True)
    specs = {
        "P,s=3": SpecConfig(stride=3, prefetch=True),
        "P,S": SpecConfig(adaptive_stride=True, prefetch=True),
    }
    for prompt in knn_prompts[:3]:
        base = run_knn_seq(prompt, lm, kb, knn, req)
        for name, spec in specs.items():
            got = run_knn_spec(prompt, lm, kb, knn, req, spec)
            assert got.tokens == base.tokens, (index, k, name, prompt)
            assert got.stats.method == f"knn-spec[{name}]"
            st = got.stats
            assert st.cache_entries > 0 or (st.spec_steps == 0 and st.cache_lookups == 0)
