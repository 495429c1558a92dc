"""KNN-LM's default speculation settings are what every entry point runs: the library with
no configuration, the served request (through the API's job builder and the replica's
KNN-LM server) and ``ralmspec bench knn``; each reports them in its statistics
(``RequestStats.knn_settings``). Also: a configuration's own KNN-LM settings, OS3's stride
cap and HNSW direct steps that ask the KB only what RaLMSeq asks."""

from __future__ import annotations

import json
import threading

import pytest

from ralm import constants as C
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.knnlm import default_spec, knn_settings, run_knn_seq, run_knn_spec
from ralm.knnlm.loop import scheduler_spec
from ralm.stride.os3 import StrideScheduler

REQ = RequestConfig(max_new_tokens=24, ignore_eos=True)


def _defaults_reported(st, kb) -> None:
    """``st.knn_settings`` are KnnLMConfig's and PS's defaults."""
    s = st.knn_settings
    assert st.method == "knn-spec[P,S]"
    assert (s["k"], s["lmbda"], s["temperature"]) == (C.KNN_K, C.KNN_LAMBDA, C.KNN_TEMPERATURE)
    assert s["prefetch"] is True and s["adaptive_stride"] is True
    assert s["fetched_per_query"] == C.KNN_PREFETCH_SIZE == 1024
    assert s["spatial_next"] == C.KNN_SPATIAL_NEXT == 20
    assert s["cache_retrievals"] == C.KNN_CACHE_RETRIEVALS == 32
    assert s["max_stride"] == C.KNN_MAX_STRIDE == 32
    # 32 answers of 1,024 entries with 20 successors each, bounded by the datastore's size
    assert s["cache_capacity"] == min(32 * 1024 * 21, len(kb.ds))
    assert max(st.strides, default=0) <= 32


def test_the_library_default_is_ps_with_the_documented_settings(knn_setups, knn_prompts):
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["flat"]
    assert KnnLMConfig().model_dump(include={"prefetch_size", "spatial_next", "cache_retrievals", "max_stride"}) == {
        "prefetch_size": 1024,
        "spatial_next": 20,
        "cache_retrievals": 32,
        "max_stride": 32,
    }
    assert default_spec() == SpecConfig(prefetch=True, adaptive_stride=True)
    base = run_knn_seq(knn_prompts[0], lm, kb, req=REQ)
    assert base.stats.knn_settings == {"k": 16, "lmbda": 0.25, "temperature": 1.0, "index": kb.name}
    got = run_knn_spec(knn_prompts[0], lm, kb, req=REQ)  # no KnnLMConfig, no SpecConfig
    assert got.tokens == base.tokens
    _defaults_reported(got.stats, kb)


def test_knn_settings_decide_prefetch_and_stride_cap_not_specconfig(knn_setups, knn_prompts):
    """KNN-LM reads p and the stride cap from KnnLMConfig: SpecConfig's document-level
    prefetch_size (20) and max_stride (16) do not change what a KNN-LM request fetches."""
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["flat"]
    knn = KnnLMConfig(k=4, lmbda=0.5, prefetch_size=64, max_stride=2, spatial_next=3, cache_retrievals=5)
    spec = SpecConfig(prefetch=True, adaptive_stride=True, prefetch_size=500, max_stride=200, gamma_prior=False)
    base = run_knn_seq(knn_prompts[1], lm, kb, knn, REQ)
    got = run_knn_spec(knn_prompts[1], lm, kb, knn, REQ, spec)
    assert got.tokens == base.tokens
    s = got.stats.knn_settings
    assert (s["fetched_per_query"], s["max_stride"], s["spatial_next"], s["cache_retrievals"]) == (64, 2, 3, 5)
    assert s["cache_capacity"] == min(max(C.KNN_CACHE_MIN_ENTRIES, 5 * 64 * 4), len(kb.ds))
    # OS3 may take direct steps throughout on this small KB; whatever it chose stays under the cap
    assert max(got.stats.strides, default=0) <= 2
    assert scheduler_spec(knn, spec).max_stride == 2 and scheduler_spec(knn, SpecConfig(stride=5)).stride == 5
    # without P only the top-k is fetched; a fixed stride reports its stride
    fixed = knn_settings(kb, knn, SpecConfig(stride=5))
    assert (fixed["fetched_per_query"], fixed["stride"], fixed["prefetch"]) == (4, 5, False)
    assert "max_stride" not in fixed


def test_hnsw_direct_steps_ask_only_the_top_k(knn_setups, knn_prompts, monkeypatch):
    """On HNSW the top-p is a second, larger search: a direct step (s = 0) asks only the
    top-k, as RaLMSeq does; a verification asks both."""
    lm, _, kbs = knn_setups["pydocs-gpt"]
    kb = kbs["hnsw"]
    knn = KnnLMConfig(k=16, lmbda=0.5, index="hnsw", prefetch_size=256)
    base = run_knn_seq(knn_prompts[2], lm, kb, knn, REQ)
    asked: list[tuple[int, int]] = []
    real = kb.search_vectors

    def recording(queries, k):
        asked.append((len(queries), k))
        return real(queries, k)

    monkeypatch.setattr(kb, "search_vectors", recording)
    with monkeypatch.context() as m:
        m.setattr(StrideScheduler, "next_stride", lambda self, position=None, remaining=None: 0)
        got = run_knn_spec(knn_prompts[2], lm, kb, knn, REQ, SpecConfig.named("PS"))
    assert got.tokens == base.tokens
    assert got.stats.direct_steps == REQ.max_new_tokens - 1
    assert asked == [(1, 16)] * REQ.max_new_tokens  # never the top-256
    asked.clear()
    got = run_knn_spec(knn_prompts[2], lm, kb, knn, REQ, SpecConfig(prefetch=True, stride=4))
    assert got.tokens == base.tokens
    assert {k for _, k in asked} == {16, 256}  # verifications fetch the top-p too


def test_a_served_request_gets_the_defaults(tmp_path, tiny_lm, knn_corpus, knn_prompts):
    """A knnlm-spec request with no spec and no knn options, through the API's job builder
    and the replica's KNN-LM server (in process): PS with KnnLMConfig's defaults, whatever
    the server's document-level SpecConfig (here none of P, S, A; prefetch 20, cap 16).
    A request's explicit prefetch_size and max_stride set KNN-LM's own."""
    from deployments.api import RalmOptions, build_job
    from deployments.modes import KnnServeOptions, KnnServer

    opts = KnnServeOptions(enabled=True, config=KnnLMConfig(datastore_dir=tmp_path / "ds", max_passage_tokens=64))
    server = KnnServer(opts, tiny_lm, knn_corpus, threading.Lock())

    def job(body: dict):
        return build_job(
            RalmOptions.model_validate({"method": "knnlm-spec", **body}),
            knn_prompts[0],
            16,
            "max_tokens",
            None,
            kinds=["edr"],
            default_method="spec",
            spec_defaults=SpecConfig(),
            request_defaults=RequestConfig(),
            max_new_limit=256,
            features={"knnlm": True},
            knn_defaults=opts.config,
        )

    res = server.run(job({"ignore_eos": True}))
    want = run_knn_seq(
        knn_prompts[0], tiny_lm, server.kb, opts.config, RequestConfig(max_new_tokens=16, ignore_eos=True)
    )
    assert res.tokens == want.tokens
    _defaults_reported(res.stats, server.kb)
    for body in (
        {"prefetch_size": 64, "spec": "PS;max_stride=3"},
        {"spec": {"prefetch": True, "adaptive_stride": True, "prefetch_size": 64, "max_stride": 3}},
    ):
        res = server.run(job({"ignore_eos": True, **body}))
        s = res.stats.knn_settings
        assert (s["fetched_per_query"], s["max_stride"]) == (64, 3), body
        assert res.tokens == want.tokens
    # the request's knn options win over its spec's fields
    s = server.run(job({"ignore_eos": True, "prefetch_size": 64, "knn": {"prefetch_size": 32}})).stats.knn_settings
    assert s["fetched_per_query"] == 32


def test_the_bench_runs_the_defaults_and_side_by_side_settings(tmp_path):
    """``ralmspec bench knn`` with no configuration flags measures PS with KnnLMConfig's
    defaults; a configuration's ``;FIELD=VALUE`` sets its own KNN-LM settings in the same run."""
    from cluster.cli import build_parser, main

    assert build_parser().parse_args(["bench", "knn"]).configs == "PS"
    old = "PS;prefetch_size=256;spatial_next=10;cache_retrievals=8;max_stride=16"
    argv = ["bench", "knn", "--passages", "6", "-n", "1", "--warmup", "0", "--max-new-tokens", "6"]
    argv += ["--ks", "16", "--indexes", "flat", "--out", str(tmp_path), "--configs", f"{old},PS"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "knn_bench.json").read_text())
    row = data["requests"][0]
    assert row["PS"]["identical"] and row[old]["identical"]
    new, before = row["PS"]["knn_settings"], row[old]["knn_settings"]
    assert (new["fetched_per_query"], new["spatial_next"], new["cache_retrievals"], new["max_stride"]) == (
        1024,
        20,
        32,
        32,
    )
    assert (before["fetched_per_query"], before["spatial_next"], before["cache_retrievals"], before["max_stride"]) == (
        256,
        10,
        8,
        16,
    )
    assert [r["config"] for r in data["summary"]] == ["baseline", old, "PS"]


def test_the_bench_rejects_bad_configurations():
    from cluster.bench.knn_bench import _knn_for, _spec

    with pytest.raises(ValueError, match="asynchronous verification"):
        _spec("PSA")
    with pytest.raises(ValueError, match="prefetch_size"):
        _knn_for("PS;prefetch_size=2000", KnnLMConfig())  # p is at most 1024
    assert _spec("Ps=8;spatial_next=4;gamma_prior=false") == SpecConfig(prefetch=True, stride=8, gamma_prior=False)
    assert _knn_for("Ps=8;spatial_next=4;gamma_prior=false", KnnLMConfig()).spatial_next == 4
