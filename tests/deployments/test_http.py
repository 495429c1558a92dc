"""The served application over HTTP: exact answers, concurrency, bad input, the OpenAI client,
a shard killed mid-request. One local Ray and one Serve app for the whole module."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.http_retry import RetryLog, send_with_retry
from ralm.config import RequestConfig
from ralm.seq import run_seq

REQ = RequestConfig(max_new_tokens=24, generation_stride=4)
KINDS = ("edr", "sr")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir):
    """The ralmspec app (EDR and SR, 2 shards each) served on a free local port."""
    from ray import serve

    from deployments.app import build_app
    from tests.actors.support import start_ray, stop_ray

    work = tmp_path_factory.mktemp("serve-work")
    (work / "indexes").mkdir()
    for kind in KINDS:
        (work / "indexes" / kind).symlink_to(index_dirs[kind], target_is_directory=True)
    args = {
        "ralm": {
            "corpus": fixture_corpus.path,
            "work_dir": str(work),
            "generator": {"model": gen_model_dir},
            "request": REQ.model_dump(),
        },
        "retrievers": list(KINDS),
        "generator_deployment": {"num_cpus": 0.2},
        "sharding": {"n_shards": 2, "num_cpus": 0.05},
        "verifier": {"window_ms": 10.0},
        "pool": {"size": 4, "max_size": 8},
        "ingress": {"admin": True},
        "build_indexes": True,
    }
    start_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="ralmspec", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=300) as client:
        yield {
            "url": url,
            "client": client,
            "model": "pydocs-gpt" if gen_model_dir.endswith("pydocs-gpt") else "tiny-gpt2",
        }
    stop_ray()


@pytest.fixture(scope="module")
def questions(fixture_questions):
    return fixture_questions[:3]


@pytest.fixture(scope="module")
def baselines(retrievers, local_generator, questions):
    """kind -> question -> in-process RaLMSeq result (the definition of the right answer)."""
    return {kind: {q: run_seq(q, local_generator, retrievers[kind], REQ) for q in questions} for kind in KINDS}


def _generate(client, q, kind, method, spec=None, log: RetryLog | None = None, **extra):
    """The answer, sent as a real client sends it: a shed answer (503/429 with Retry-After) is
    retried after that delay, a bounded number of times; the retries go to ``log``."""
    body = {"question": q, "retriever": kind, "method": method, **extra}
    if spec is not None:
        body["spec"] = spec
    res = send_with_retry(lambda: client.post("/v1/ralm/generate", json=body))
    if log is not None:
        log.add(res)
    r = res.response
    assert r.status_code == 200, f"{r.text} (after {res.retries} retries: {res.reasons})"
    return r.json()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "method,spec", [("seq", None), ("spec", "PSA"), ("spec", {"stride": 3})], ids=["seq", "PSA", "base-s3"]
)
def test_http_answer_equals_in_process_seq(server, baselines, questions, kind, method, spec):
    for q in questions[:2]:
        res = _generate(server["client"], q, kind, method, spec)
        base = baselines[kind][q]
        assert res["tokens"] == base.tokens, (kind, method, q)
        assert res["stats"]["doc_ids"] == base.stats.doc_ids
        assert res["text"] == base.text
        assert res["stats"]["retriever"] == kind and res["prompt_tokens"] > 0


def test_completions_endpoint(server, baselines, questions):
    c = server["client"]
    q = questions[0]
    r = c.post(
        "/v1/completions",
        json={"model": server["model"], "prompt": q, "max_tokens": REQ.max_new_tokens, "retriever": "sr", "spec": "PS"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    base = baselines["sr"][q]
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == base.text
    assert body["choices"][0]["finish_reason"] == base.finish_reason
    assert body["usage"]["completion_tokens"] == len(base.tokens)
    assert body["ralm"]["tokens"] == base.tokens and body["ralm"]["stats"]["method"] == "spec[PS]"
    r = c.post("/v1/completions", json={"prompt": [q], "max_tokens": 8, "echo": True, "method": "seq"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(q)
    models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == server["model"]
    assert c.get("/healthz").json()["status"] == "ok"


def test_sixteen_concurrent_requests_are_all_exact(server, baselines, questions):
    jobs = [
        (questions[i % len(questions)], KINDS[i % 2], ("seq", "spec")[(i // 2) % 2], ("PSA", "A", "base", "P")[i % 4])
        for i in range(16)
    ]

    log = RetryLog()

    def one(job):
        q, kind, method, spec = job
        with httpx.Client(base_url=server["url"], timeout=600) as c:
            return _generate(c, q, kind, method, spec if method == "spec" else None, log=log)

    t0 = time.time()
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, jobs))
    for (q, kind, method, spec), res in zip(jobs, results):
        assert res["tokens"] == baselines[kind][q].tokens, (q, kind, method, spec)
    stats = server["client"].get("/v1/ralm/stats").json()
    assert stats["pool"]["size"] <= 8
    assert sum(v["submissions"] for v in stats["verifiers"].values()) > 0
    print(
        f"16 concurrent requests in {time.time() - t0:.1f}s; retries of shed requests: {log.as_dict()}; batches:",
        {k: v["sizes"] for k, v in stats["verifiers"].items()},
    )


def _batched_iterations(client) -> tuple[int, dict]:
    """Generator forward passes that held more than one sequence so far, and the batching stats."""
    gen = client.get("/v1/ralm/stats").json()["generator"]["batching"]
    return sum(n for bucket, n in gen["batch_size_histogram"].items() if bucket != "<=1"), gen


def test_concurrent_requests_share_the_generators_forward_passes(server, baselines, questions):
    """16 concurrent requests, RaLMSeq and RaLMSpec PSA mixed, through the continuously batched
    generator: each gets exactly the tokens of in-process RaLMSeq run alone, and steps of
    different requests shared forward passes."""
    before, _ = _batched_iterations(server["client"])
    jobs = [(questions[i % len(questions)], KINDS[i % 2], ("seq", "spec")[(i // 2) % 2]) for i in range(16)]

    log = RetryLog()

    def one(job):
        q, kind, method = job
        with httpx.Client(base_url=server["url"], timeout=600) as c:
            return _generate(c, q, kind, method, "PSA" if method == "spec" else None, log=log)

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, jobs))
    print(f"retries of shed requests: {log.as_dict()}")
    for (q, kind, method), res in zip(jobs, results):
        assert res["tokens"] == baselines[kind][q].tokens, (q, kind, method)
    after, gen = _batched_iterations(server["client"])
    assert after > before, gen
    assert gen["max_batch"] > 1 and gen["steps_done"] > 0 and gen["sessions"]["takes"] > 0


BAD = [
    # (body, status, message fragment)
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "   "}, 400, "empty"),
    ({"prompt": 42}, 400, "prompt"),
    ({"max_tokens": 5}, 400, "'prompt' is required"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be between"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens must be between"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "retriever": "faiss-ivf"}, 400, "unknown retriever 'faiss-ivf'"),
    ({"prompt": "hi", "retriever": "adr"}, 400, "this server serves edr, sr"),
    ({"prompt": "hi", "method": "magic"}, 400, "method"),
    ({"prompt": "hi", "spec": "PXQ"}, 400, "unknown RaLMSpec configuration"),
    ({"prompt": "hi", "spec": {"stride": 0}}, 400, "stride"),
    ({"prompt": "hi", "spec": {"warp": True}}, 400, "unknown field 'spec.warp'"),
    ({"prompt": "hi", "drafting": "dense"}, 400, "dense drafting is not enabled on this server"),
    ({"prompt": "hi", "method": "knnlm-spec"}, 400, "knnlm is not enabled on this server"),
    ({"prompt": "hi", "num_docs": 99}, 400, "num_docs: Input should be less than or equal to 8"),
    ({"prompt": "hi", "temperature": 0.8}, 400, "greedy"),
    ({"prompt": "hi", "n": 3}, 400, "n=1"),
    ({"prompt": "hi", "stop": ["\n"]}, 400, "stop"),
    ({"prompt": "hi", "retreiver": "edr"}, 400, "unknown field 'retreiver'"),
    ({"prompt": ["a", "b"]}, 400, "exactly one prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "word " * 2000}, 400, "tokens long; the limit is"),
    ({"prompt": "x" * 50000}, 400, "characters long"),
]


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server, baselines, questions):
    c = server["client"]
    for body, status, frag in BAD:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert frag in err["message"], (body, err)
        assert err["type"] in ("invalid_request_error",)
    for raw in (b"{not json", b"", b"[1, 2]", b'{"prompt": "unterminated'):
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, raw
        assert r.json()["error"]["message"]
    r = c.post("/v1/ralm/generate", json={"question": None})
    assert r.status_code == 400 and "question" in r.json()["error"]["message"]
    r = c.post("/v1/ralm/generate", json={"question": "hi", "max_new_tokens": -1})
    assert r.status_code == 400
    assert c.get("/v1/nothing-here").status_code == 404
    # still serving, and still exact
    assert c.get("/healthz").status_code == 200
    q = questions[1]
    assert _generate(c, q, "edr", "spec", "PSA")["tokens"] == baselines["edr"][q].tokens


def test_openai_client_completions_and_streaming(server, baselines, questions):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="dummy", max_retries=0, timeout=300)
    assert server["model"] in [m.id for m in client.models.list().data]
    q = questions[2]
    base = baselines["edr"][q]
    out = client.completions.create(
        model=server["model"],
        prompt=q,
        max_tokens=REQ.max_new_tokens,
        temperature=0,
        extra_body={"retriever": "edr", "spec": "PSA"},
    )
    assert out.choices[0].text == base.text
    assert out.usage.completion_tokens == len(base.tokens)
    chunks = list(
        client.completions.create(
            model=server["model"],
            prompt=q,
            max_tokens=REQ.max_new_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"retriever": "edr", "spec": "PSA"},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == base.text
    assert chunks[-1].choices[0].finish_reason == base.finish_reason
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) >= 2  # really incremental
    with pytest.raises(openai.BadRequestError, match="unknown retriever"):
        client.completions.create(model=server["model"], prompt=q, max_tokens=4, extra_body={"retriever": "x"})


def test_openai_client_chat_and_embeddings(server, baselines, questions, dense_encoder):
    """The official client's chat (plain and streamed) and embeddings calls. The demo model has
    no chat template, so one user message is the completion prompt: the answer is RaLMSeq's."""
    openai = pytest.importorskip("openai")
    np = pytest.importorskip("numpy")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="dummy", max_retries=0, timeout=300)
    q = questions[1]
    base = baselines["sr"][q]
    msgs = [{"role": "user", "content": q}]
    extra = {"retriever": "sr", "spec": "PSA"}
    out = client.chat.completions.create(
        model=server["model"], messages=msgs, max_tokens=REQ.max_new_tokens, extra_body=extra
    )
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == base.text
    assert out.choices[0].finish_reason == base.finish_reason and out.usage.completion_tokens == len(base.tokens)
    stream = client.chat.completions.create(model=server["model"], messages=msgs, stream=True, extra_body=extra)
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == base.text
    assert chunks[-1].choices[0].finish_reason == base.finish_reason
    # embeddings: the encoder's query vectors (the official client asks for base64 by default)
    texts = [q, "posixpath.join"]
    emb = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    got = np.array([d.embedding for d in emb.data], dtype=np.float32)
    want = np.stack([dense_encoder.encode_query(t) for t in texts])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert emb.usage.prompt_tokens > 0 and emb.model == "all-MiniLM-L6-v2"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def test_schemathesis_against_the_served_app(server, baselines, questions, tmp_path):
    """The fuzzer against the Ray-served app (real generator, shards, verifier): no 5xx and no
    hang; afterwards the server still answers, exactly. (The admin route is left out: it would
    change the verifier policy under the other tests.)"""
    from tests.deployments.serving import run_schemathesis

    cases = run_schemathesis(
        server["url"], tmp_path, max_examples=10, phases="fuzzing", extra=("--exclude-path", "/v1/ralm/admin/verifier")
    )
    assert cases >= 35, cases  # 7 operations, at least 5 cases each
    q = questions[0]
    res = _generate(server["client"], q, "edr", "spec", "PSA")
    assert res["tokens"] == baselines["edr"][q].tokens


def test_streaming_raw_sse(server, baselines, questions):
    q = questions[0]
    events = []
    with server["client"].stream(
        "POST",
        "/v1/completions",
        json={"prompt": q, "max_tokens": REQ.max_new_tokens, "stream": True, "retriever": "sr", "method": "seq"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert "".join(o["choices"][0]["text"] for o in objs) == baselines["sr"][q].text
    assert objs[-1]["ralm"]["tokens"] == baselines["sr"][q].tokens


def _stats(server) -> dict:
    r = server["client"].get("/v1/ralm/stats")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_client_that_leaves_mid_stream_cancels_its_request(server, questions):
    """The client reads one SSE chunk and disconnects: the coordinator stops at its next step
    (fewer generator steps than the request's 128), goes back to the pool, and the request's
    KV sessions at the generator are freed. Stride 1 gives the disconnect a long window to be
    noticed in (a retrieval and a step per token), even on a loaded machine."""
    before = _stats(server)
    steps0, cancelled0 = before["generator"]["steps"], before["pool"]["cancelled"]
    body = {
        "prompt": questions[1],
        "max_tokens": 128,
        "generation_stride": 1,
        "ignore_eos": True,
        "stream": True,
        "method": "seq",
    }
    with httpx.Client(base_url=server["url"], timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then the connection closes
    deadline = time.time() + 60
    while True:
        st = _stats(server)
        pool, sessions = st["pool"], st["generator"]["batching"]["sessions"]
        if pool["cancelled"] > cancelled0 and pool["idle"] == pool["size"] and sessions["sessions"] == 0:
            break
        assert time.time() < deadline, (pool, sessions)
        time.sleep(0.2)
    assert st["generator"]["steps"] - steps0 < 128  # stopped early: 128 tokens at stride 1 is 128 steps
    again = _generate(server["client"], questions[1], "edr", "seq")  # and the server keeps serving
    assert again["tokens"]


def test_shard_killed_mid_http_request(server, retrievers, local_generator, questions):
    """A shard actor dies (and restarts) while a request is running; the answer is still exact."""
    import ray

    c = server["client"]
    req = RequestConfig(max_new_tokens=64, generation_stride=2)
    q = questions[1]
    expected = run_seq(q, local_generator, retrievers["edr"], req)
    shards = c.get("/v1/ralm/stats").json()["shards"]["edr"]
    victim = ray.get_actor(shards["names"][0], namespace=shards["namespace"])
    pid_before = ray.get(victim.ping.remote())
    box: dict = {}

    def request():
        box["res"] = _generate(
            c, q, "edr", "seq", max_new_tokens=req.max_new_tokens, generation_stride=req.generation_stride
        )
        box["done"] = time.time()

    def kb_calls() -> int:
        return c.get("/v1/ralm/stats").json()["verifiers"]["edr"]["submissions"]

    before = kb_calls()
    t = threading.Thread(target=request)
    t.start()
    deadline = time.time() + 120
    while kb_calls() < before + 3 and time.time() < deadline:  # the request is under way
        time.sleep(0.005)
    killed_at = time.time()
    ray.kill(victim, no_restart=False)
    t.join(300)
    assert box["done"] > killed_at, "the request finished before the shard was killed"
    assert box["res"]["tokens"] == expected.tokens
    assert box["res"]["stats"]["doc_ids"] == expected.stats.doc_ids
    assert ray.get(victim.ping.remote()) != pid_before
    assert c.get("/healthz").status_code == 200


def test_served_bench_tiny_run(server, tmp_path, questions):
    """The served benchmark end to end on the running server (tiny: correctness, not speed)."""
    import argparse

    from cluster.bench.served_bench import add_served_bench_args, served_bench_main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions[:2]))
    p = argparse.ArgumentParser()
    add_served_bench_args(p)
    args = p.parse_args(
        [
            "--url",
            server["url"],
            "--questions",
            str(qfile),
            "-n",
            "2",
            "--concurrency",
            "1,2",
            "--retrievers",
            "edr",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "out"),
            "--methods",
            "seq,spec:PSA,spec:PS@0.9",
            "--max-inflight",
            "1",
            "--wait-for-speculating",
            "on,off",
        ]
    )
    try:
        assert served_bench_main(args) == 0
    finally:
        httpx.post(
            server["url"] + "/v1/ralm/admin/verifier",
            json={"max_inflight": 2, "wait_for_speculating": False},
            timeout=60,
        )
    data = json.loads((tmp_path / "out" / "served_bench.json").read_text())
    rows = data["rows"]
    assert {r["method"] for r in rows} == {"seq", "spec[PSA]", "spec[PS@0.9]"}
    assert any("max_inflight 1" in n for n in data["notes"])
    assert {r["batching"] for r in rows} == {True, False}
    # both verifier settings side by side when batching is on; none switched when it is off
    assert {(r["batching"], r["wait_for_speculating"]) for r in rows} == {(True, True), (True, False), (False, None)}
    assert {r["concurrency"] for r in rows} == {1, 2}
    assert all(r["identical"] == r["requests"] == 2 for r in rows)
    assert all(r["p50_s"] > 0 and r["p95_s"] >= r["p50_s"] and r["throughput_rps"] > 0 for r in rows)
    # with batching off every RaLMSeq submission (one query) is searched on its own
    assert all(r["queries_per_search"] == 1.0 for r in rows if r["method"] == "seq" and not r["batching"])
    # where the time went: the server reports each request's wait for a coordinator
    assert all(r["queue_s"] >= 0 and r["gen_s"] > 0 and r["overhead_s"] >= 0 for r in rows)
    md = (tmp_path / "out" / "served_bench.md").read_text()
    assert "p95" in md and "RaLMSpec" in md and "Where a request's time went" in md


def test_served_bench_open_loop_tiny_run(server, tmp_path, questions):
    """The open-loop sweep end to end (tiny: correctness, not speed): Poisson arrivals at two
    rates, streamed answers, every answer equal to RaLMSeq's, the report and its plot."""
    import argparse

    from cluster.bench.open_loop import capacity
    from cluster.bench.served_bench import add_served_bench_args, served_bench_main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions[:3]))
    p = argparse.ArgumentParser()
    add_served_bench_args(p)
    out = tmp_path / "open"
    argv = ["--url", server["url"], "--questions", str(qfile), "-n", "3", "--rate", "0.5,4", "--retrievers", "edr"]
    argv += ["--max-new-tokens", "8", "--methods", "seq,spec:PSA", "--lone", "2", "--out", str(out)]
    assert served_bench_main(p.parse_args(argv)) == 0
    data = json.loads((out / "open_loop.json").read_text())
    assert {(r["method"], r["rate"]) for r in data["rows"]} == {
        (m, r) for m in ("seq", "spec[PSA]") for r in (0.5, 4.0)
    }
    for r in data["rows"]:
        assert r["ok"] == r["identical"] == r["requests"] == 3 and r["shed"] == r["lost"] == 0
        assert 0 < r["ttft_p50_s"] <= r["p50_s"] <= r["p90_s"] <= r["p99_s"] and r["goodput_rps"] <= r["throughput_rps"]
    assert data["lone"]["seq"]["requests"] == 3 and data["lone"]["spec[PSA]"]["requests"] == 2
    assert set(data["capacity"]) == set(data["capacity_at_slo"]) == {"seq", "spec[PSA]"}
    for m, rows in (("seq", data["rows"][0::2]), ("spec[PSA]", data["rows"][1::2])):
        assert data["capacity_at_slo"][m] == capacity(rows, data["slo_s"], factor=1.0)
    assert (out / "open_loop.png").stat().st_size > 0
    assert "latency versus arrival rate" in (out / "open_loop.md").read_text()


def test_admin_switches_batching(server):
    """The admin API sets each field it is given (and only those) on every verifier."""
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        off = c.post("/v1/ralm/admin/verifier", json={"batching": False}).json()
        assert off and all(v["batching"] is False for v in off.values())
        on = c.post("/v1/ralm/admin/verifier", json={"batching": True, "window_ms": 3.0}).json()
        assert all(v["batching"] is True and v["window_ms"] == 3.0 for v in on.values())
        assert all(v["max_batch"] == off[k]["max_batch"] for k, v in on.items())
        assert c.post("/v1/ralm/admin/verifier", json={"bogus": 1}).status_code == 400
        one = c.post("/v1/ralm/admin/verifier", json={"max_inflight": 1}).json()
        assert all(v["max_inflight"] == 1 and v["window_ms"] == 3.0 for v in one.values())
        bad = c.post("/v1/ralm/admin/verifier", json={"max_inflight": 0})
        assert bad.status_code == 400 and "max_inflight" in bad.text
        back = c.post("/v1/ralm/admin/verifier", json={"max_inflight": off[next(iter(off))]["max_inflight"]}).json()
        assert all(v["max_inflight"] == off[k]["max_inflight"] for k, v in back.items())


@pytest.mark.slow
def test_served_bench_default_levels(server, tmp_path):
    """The benchmark at its default shape (1, 4, 16 in flight; 16 requests): minutes on 2 cores."""
    import argparse

    from cluster.bench.served_bench import add_served_bench_args, served_bench_main

    p = argparse.ArgumentParser()
    add_served_bench_args(p)
    args = p.parse_args(
        ["--url", server["url"], "--retrievers", "edr,sr", "--max-new-tokens", "24", "--out", str(tmp_path / "out")]
    )
    assert served_bench_main(args) == 0
