"""Per-request generation modes over real HTTP (one local Ray + Serve app for the module, with
dense drafting and KNN-LM enabled): each mode returns the in-process loop's tokens for the same
RequestConfig, reports its own statistics, and bad values get a 4xx while the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from ralm.config import GeneratorConfig, KnnLMConfig, RequestConfig, SpecConfig
from ralm.seq import run_seq
from tests.deployments.serving import app_args, serve_app

REQ = RequestConfig(max_new_tokens=24, generation_stride=4)  # the server's request defaults
KINDS = ("edr", "sr")
KNN_PASSAGES, KNN_MAX_TOKENS = 30, 96


@pytest.fixture(scope="module")
def ref_gen(gen_model_dir, fixture_corpus, tmp_path_factory):
    """In-process reference generator with the dense drafting datastore the server loads."""
    from ralm.drafting.dense import DenseDatastore, build_datastore, collect_corpus
    from ralm.engine import LMEngine
    from ralm.generator import LocalGenerator

    engine = LMEngine.from_config(GeneratorConfig(model=gen_model_dir))
    path = tmp_path_factory.mktemp("dense") / "dense.npz"
    keys, values = collect_corpus(engine, (fixture_corpus.text(i) for i in range(40)))
    build_datastore(keys, values).save(path)
    engine.attach_dense_datastore(DenseDatastore.load(path))
    gen = LocalGenerator(engine, fixture_corpus)
    gen.dense_path = path
    return gen


@pytest.fixture(scope="module")
def knn_setup(ref_gen, fixture_corpus, tmp_path_factory):
    """(datastore dir, in-process KnnRetriever) of a small token datastore of the fixture corpus."""
    from ralm.knnlm import build_datastore, load_knn_retriever

    d = tmp_path_factory.mktemp("knn") / "datastore"
    ds = build_datastore(
        ref_gen.engine, fixture_corpus, n_passages=KNN_PASSAGES, max_passage_tokens=KNN_MAX_TOKENS, progress=False
    )
    ds.save(d)
    return d, load_knn_retriever(ds, KnnLMConfig(max_passage_tokens=KNN_MAX_TOKENS))


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir, ref_gen, knn_setup):
    from tests.actors.support import stop_ray

    args = app_args(
        tmp_path_factory.mktemp("modes-work"),
        index_dirs,
        fixture_corpus,
        gen_model_dir,
        KINDS,
        REQ,
        dense_drafting={"datastore": str(ref_gen.dense_path)},
        knnlm={
            "enabled": True,
            "n_passages": KNN_PASSAGES,
            "config": {"datastore_dir": str(knn_setup[0]), "max_passage_tokens": KNN_MAX_TOKENS},
        },
    )
    args["ralm"]["spec"] = SpecConfig.named("PSA").model_dump()  # the served default, as in serve_config.yaml
    url = serve_app(args)
    with httpx.Client(base_url=url, timeout=300) as client:
        yield {"url": url, "client": client}
    stop_ray()


@pytest.fixture(scope="module")
def questions(fixture_questions):
    return fixture_questions[:2]


def _post(client, body: dict, path: str = "/v1/ralm/generate") -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_advertises_its_modes(server):
    c = server["client"]
    assert c.get("/v1/models").json()["data"][0]["features"] == {"dense_drafting": True, "knnlm": True}
    gen = c.get("/v1/ralm/stats").json()["generator"]
    assert gen["dense_drafting"]["entries"] > 0 and not gen["dense_drafting"]["built"]
    assert gen["knnlm"]["entries"] > 0 and gen["knnlm"]["built"] is False  # the datastore was loaded


# (id, retriever, request fields, methods)
MODES = [
    ("ngram", "edr", {"drafting": "ngram"}, ("seq", "PSA")),
    ("ngram-n3-m4", "sr", {"drafting": "ngram", "ngram_n": 3, "ngram_min_n": 1, "ngram_m": 4}, ("PSA",)),
    ("dense", "edr", {"drafting": "dense", "dense_num_drafts": 2, "dense_draft_len": 6}, ("seq", "PSA")),
    ("num_docs-2", "edr", {"num_docs": 2}, ("seq", "PSA")),
    ("num_docs-3-ngram", "sr", {"num_docs": 3, "drafting": "ngram"}, ("P",)),
    ("flare", "edr", {"workload": "flare", "flare_threshold": 0.3}, ("seq", "PSA")),
    ("iter_retgen", "sr", {"workload": "iter_retgen", "iter_retgen_iterations": 3}, ("seq", "PS")),
    ("ignore_eos-k2", "edr", {"ignore_eos": True, "generation_stride": 2}, ("base",)),
]


@pytest.mark.parametrize("kind,fields,methods", [m[1:] for m in MODES], ids=[m[0] for m in MODES])
def test_each_mode_over_http_returns_the_in_process_tokens(
    server, ref_gen, retrievers, questions, kind, fields, methods
):
    req = REQ.model_copy(update=fields)
    for q in questions:
        want = run_seq(q, ref_gen, retrievers[kind], req)
        for m in methods:
            body = {"question": q, "retriever": kind, **fields}
            body.update({"method": "seq"} if m == "seq" else {"method": "spec", "spec": m})
            res = _post(server["client"], body)
            assert res["tokens"] == want.tokens, (kind, fields, m, q)
            assert res["stats"]["doc_ids"] == [list(d) if isinstance(d, tuple) else d for d in want.stats.doc_ids]
            st = res["stats"]
            assert res["exact"] is True and st["exact"] is True and st["inexact_options"] == []
            assert (st["drafting"], st["workload"], st["num_docs"]) == (req.drafting, req.workload, req.num_docs)
            assert st["forward_passes"] > 0 and st["generated_tokens"] >= len(res["tokens"])
            if m == "seq":  # the same steps: the same statistics, carried up to HTTP
                for name in (
                    "forward_passes",
                    "generated_tokens",
                    "draft_rounds",
                    "drafted_tokens",
                    "accepted_tokens",
                    "low_confidence_stops",
                    "gen_steps",
                ):
                    assert st[name] == getattr(want.stats, name), (name, fields)


def test_ngram_drafting_reports_fewer_forward_passes_than_tokens(server, fixture_corpus):
    c = server["client"]
    prompt = "Copy the text: " + fixture_corpus.text(10)[:200]  # copy-friendly
    base = {
        "question": prompt,
        "retriever": "sr",
        "method": "seq",
        "max_new_tokens": 32,
        "generation_stride": 8,
        "ignore_eos": True,
    }
    plain = _post(c, {**base, "drafting": "none"})["stats"]
    assert plain["forward_passes"] == plain["generated_tokens"] == 32 and plain["tokens_per_forward"] == 1.0
    assert plain["drafted_tokens"] == 0 and plain["acceptance_rate"] is None
    res = _post(c, {**base, "drafting": "ngram"})
    st = res["stats"]
    assert st["drafting"] == "ngram" and st["generated_tokens"] == 32
    assert st["forward_passes"] < st["generated_tokens"] and st["tokens_per_forward"] > 1.0
    assert st["draft_rounds"] > 0 and 0 < st["accepted_tokens"] <= st["drafted_tokens"]
    assert 0 < st["acceptance_rate"] <= 1 and st["accepted_per_verify_pass"] > 0
    assert res["exact"] is True


def test_dense_drafting_never_costs_more_forward_passes(server, questions):
    st = _post(
        server["client"],
        {
            "question": questions[0],
            "retriever": "edr",
            "method": "seq",
            "drafting": "dense",
            "ignore_eos": True,
            "generation_stride": 8,
        },
    )["stats"]
    assert st["drafting"] == "dense" and st["generated_tokens"] == REQ.max_new_tokens
    assert 0 < st["forward_passes"] <= st["generated_tokens"]
    assert st["accepted_tokens"] <= st["drafted_tokens"]


def test_doc_kv_statistics_with_several_documents(server, questions):
    c = server["client"]
    body = {"question": questions[1], "retriever": "edr", "method": "spec", "spec": "PS", "num_docs": 2}
    first = _post(c, body)["stats"]
    assert first["doc_kv_docs_reused"] + first["doc_kv_misses"] == 2 * first["gen_steps"]
    second = _post(c, body)["stats"]  # every document's KV is cached now
    assert second["doc_kv_misses"] == 0 and second["doc_kv_hits"] == second["gen_steps"] > 0
    assert second["doc_kv_docs_reused"] == 2 * second["gen_steps"] and second["doc_kv_hit_rate"] == 1.0
    assert second["doc_kv_bytes_reused"] > 0


def test_inexact_options_are_accepted_explicitly_and_flagged(server, ref_gen, retrievers, questions):
    c = server["client"]
    q = questions[0]
    req = REQ.model_copy(update={"idgr": True, "num_docs": 2, "idgr_unrelated": 1})
    want = run_seq(q, ref_gen, retrievers["edr"], req)
    res = _post(
        c,
        {
            "question": q,
            "retriever": "edr",
            "method": "spec",
            "spec": "PSA",
            "idgr": True,
            "num_docs": 2,
            "idgr_unrelated": 1,
        },
    )
    assert res["tokens"] == want.tokens  # RaLMSpec still equals RaLMSeq with the same prompt ...
    assert res["exact"] is False and res["stats"]["inexact_options"] == ["idgr"]  # ... but not plain RaLMSeq's
    out = _post(
        c,
        {"prompt": q, "max_tokens": 8, "retriever": "edr", "num_docs": 2, "allow_inexact_shifted_reuse": True},
        "/v1/completions",
    )
    assert out["ralm"]["exact"] is False and out["ralm"]["stats"]["inexact_options"] == ["allow_inexact_shifted_reuse"]
    plain = _post(c, {"prompt": q, "max_tokens": 8, "retriever": "edr", "num_docs": 2}, "/v1/completions")
    assert plain["ralm"]["exact"] is True  # never on unless asked for


KNN = [
    ("knnlm-seq", None, None),
    ("knnlm-spec", {"stride": 3}, None),
    ("knnlm-spec", "S", {"k": 4, "lmbda": 0.5}),
    ("knnlm-spec", "base", {"spatial_next": 2, "temperature": 2.0}),
]


@pytest.mark.parametrize("method,spec,knn", KNN, ids=["seq", "s3", "S-k4", "base-n2"])
def test_knnlm_over_http_returns_the_in_process_tokens(server, ref_gen, knn_setup, questions, method, spec, knn):
    from ralm.knnlm import run_knn_seq

    kb = knn_setup[1]
    cfg = KnnLMConfig(max_passage_tokens=KNN_MAX_TOKENS, **(knn or {}))
    for q in questions:
        want = run_knn_seq(q, ref_gen.engine, kb, cfg, RequestConfig(max_new_tokens=REQ.max_new_tokens))
        body = {"question": q, "method": method}
        if spec is not None:
            body["spec"] = spec
        if knn is not None:
            body["knn"] = knn
        res = _post(server["client"], body)
        assert res["tokens"] == want.tokens and res["text"] == want.text, (method, spec, knn, q)
        st = res["stats"]
        assert res["retriever"] == "knn" and res["method"] == method and res["exact"] is True
        assert st["method"].startswith("knn-seq" if method == "knnlm-seq" else "knn-spec")
        assert st["knn_k"] == cfg.k and st["forward_passes"] > 0
        assert st["generated_tokens"] >= len(res["tokens"])
        assert st["knn_settings"]["k"] == cfg.k and st["knn_settings"]["lmbda"] == cfg.lmbda
        if method == "knnlm-spec":  # the server's KNN-LM settings (KnnLMConfig's defaults underneath)
            assert st["knn_settings"]["spatial_next"] == cfg.spatial_next
            assert st["knn_settings"]["cache_retrievals"] == cfg.cache_retrievals == 32
        if method == "knnlm-seq":
            assert st["kb_calls"] == st["steps"]
        elif st["direct_steps"]:
            # OS3 (the server's default spec is adaptive) may take direct steps throughout on
            # this tiny datastore, where a retrieval costs less than a rollback, and the
            # coordinator's gamma prior remembers that from the previous question
            assert "S" in st["method"] and st["direct_steps"] + st["verifications"] > 0
        else:
            assert st["verifications"] > 0 and st["matched_steps"] + st["rollbacks"] > 0


def test_streaming_with_modes(server, ref_gen, retrievers, knn_setup, questions):
    from ralm.knnlm import run_knn_seq

    q = questions[1]
    cases = [
        (
            {"retriever": "sr", "spec": "PSA", "drafting": "ngram", "num_docs": 2},
            run_seq(q, ref_gen, retrievers["sr"], REQ.model_copy(update={"drafting": "ngram", "num_docs": 2})),
        ),
        (
            {"method": "knnlm-spec", "spec": {"stride": 2}},
            run_knn_seq(
                q,
                ref_gen.engine,
                knn_setup[1],
                KnnLMConfig(max_passage_tokens=KNN_MAX_TOKENS),
                RequestConfig(max_new_tokens=REQ.max_new_tokens),
            ),
        ),
    ]
    for extra, want in cases:
        events = []
        with server["client"].stream(
            "POST", "/v1/completions", json={"prompt": q, "max_tokens": REQ.max_new_tokens, "stream": True, **extra}
        ) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        objs = [json.loads(e) for e in events[:-1]]
        assert "".join(o["choices"][0]["text"] for o in objs) == want.text, extra
        assert objs[-1]["ralm"]["tokens"] == want.tokens and objs[-1]["ralm"]["exact"] is True


BAD = [
    ({"drafting": "beam"}, "drafting"),
    ({"ngram_n": 0}, "ngram_n: Input should be greater than or equal to 1"),
    ({"ngram_m": 100000}, "ngram_m: Input should be less than or equal to 256"),
    ({"num_docs": 0}, "num_docs"),
    ({"num_docs": "2"}, "num_docs"),
    ({"flare_threshold": 0}, "flare_threshold: Input should be greater than 0"),
    ({"workload": "active"}, "workload"),
    ({"iter_retgen_iterations": -3}, "iter_retgen_iterations"),
    ({"idgr": "true"}, "idgr"),
    ({"allow_inexact_shifted_reuse": 1}, "allow_inexact_shifted_reuse"),
    ({"knn": {"k": 4}}, "knn options apply only to methods"),
    ({"method": "knnlm"}, "method"),
    ({"method": "knnlm-spec", "knn": {"k": 5000}}, "knn.k: Input should be less than or equal to 1024"),
    ({"method": "knnlm-spec", "spec": "PSA"}, "asynchronous verification (A) is not supported for KNN-LM"),
    ({"method": "knnlm-spec", "drafting": "ngram"}, "drafting does not apply to method 'knnlm-spec'"),
    ({"method": "knnlm-seq", "knn": {"index": "hnsw"}}, "unknown field 'knn.index'"),
]


def test_bad_mode_values_get_4xx_and_the_server_keeps_serving(server, ref_gen, retrievers, questions):
    c = server["client"]
    for extra, fragment in BAD:
        for path, body in (
            ("/v1/ralm/generate", {"question": "hi", **extra}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert fragment in err["message"], (body, err)
    # a request that passes validation but cannot run (too long for the model) is a 400 too
    r = c.post(
        "/v1/ralm/generate", json={"question": "word " * 250, "retriever": "edr", "num_docs": 8, "max_new_tokens": 128}
    )
    assert r.status_code == 400 and "positions" in r.json()["error"]["message"], r.text
    assert c.get("/healthz").status_code == 200
    q = questions[0]
    req = REQ.model_copy(update={"drafting": "ngram", "num_docs": 2})
    want = run_seq(q, ref_gen, retrievers["edr"], req)
    assert _post(c, {"question": q, "retriever": "edr", "drafting": "ngram", "num_docs": 2})["tokens"] == want.tokens


def test_served_bench_measures_a_mode(server, tmp_path, questions):
    import argparse

    from cluster.bench.served_bench import add_served_bench_args, served_bench_main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question": questions[0]}) + "\n")
    p = argparse.ArgumentParser()
    add_served_bench_args(p)
    args = p.parse_args(
        [
            "--url",
            server["url"],
            "--questions",
            str(qfile),
            "-n",
            "1",
            "--concurrency",
            "1",
            "--retrievers",
            "edr",
            "--max-new-tokens",
            "16",
            "--batching",
            "on",
            "--warmup",
            "0",
            "--options",
            '{"drafting": "ngram", "num_docs": 2}',
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert served_bench_main(args) == 0
    data = json.loads((tmp_path / "out" / "served_bench.json").read_text())
    assert data["meta"]["options"] == {"drafting": "ngram", "num_docs": 2}
    for row in data["rows"]:
        assert row["identical"] == row["requests"] == 1 and row["exact"] is True
        assert row["tokens_per_forward"] >= 1.0 and row["doc_kv_hit_rate"] is not None
        assert row["options"] == {"drafting": "ngram", "num_docs": 2}
    assert "tok/fwd" in (tmp_path / "out" / "served_bench.md").read_text()
    with pytest.raises(SystemExit):
        p.parse_args(["--options", '{"method": "seq"}'])
