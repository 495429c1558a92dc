"""The HTTP API over an in-process backend, without Ray: auth, body limits, validation, the
OpenAI-compatible shapes, server-sent events, error mapping.

The backend runs the core loops as they are (:func:`ralm.seq.run_seq`,
:func:`ralm.spec.run_spec`) over the scripted test doubles of ``tests/factories.py``, so
the answers, their statistics and the streamed chunks are real; the Ray topology is tested
over real HTTP in ``test_http.py``."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from deployments.backend import BackendUnavailable
from deployments.ingress import IngressSettings, build_http_app
from ralm import constants as C
from ralm.chat import chat_prompt
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.errors import ConfigError, Overloaded, RalmInputError
from ralm.job import RalmJob
from ralm.results import RalmResult
from ralm.seq import run_seq
from ralm.spec import run_spec
from tests.factories import ScriptedGenerator, ScriptedKB

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key-5d2e"
LIMIT = 4096
MODEL = "scripted-lm"
REQ = RequestConfig(max_new_tokens=12, generation_stride=3)
QUESTION = "what does json dumps do"
SCHEDULE = {0: 4, 1: 7, 2: 7, 3: 2}  # the KB's top-1 per retrieval step


def answer(question: str, job: RalmJob, on_commit=None) -> RalmResult:
    """A job run by the core loops over fresh scripted parts (the reference for the HTTP answers)."""
    gen = ScriptedGenerator()
    q = gen.encode_question(question)
    kb = ScriptedKB(dict(SCHEDULE), n_q=len(q), k=job.request.generation_stride, name=job.source)
    if job.info.speculative:
        return run_spec(question, gen, kb, job.request, job.spec, on_commit=on_commit)
    return run_seq(question, gen, kb, job.request, on_commit=on_commit)


class InProcessBackend:
    """:class:`~deployments.backend.RalmBackend` in this process: no Ray, no actors."""

    features = {"dense_drafting": False, "knnlm": False}
    max_prompt_tokens = 40
    max_new_tokens = 64

    def __init__(self):
        self.jobs: list[RalmJob] = []
        self.fail: Exception | None = None  # raised by the next request
        self.unhealthy: str | None = None
        self.policies: list[tuple[dict, bool]] = []
        self.closed_streams = 0
        self.embedded: list[list[str]] = []

    def encode_question(self, question: str) -> list[int]:
        if not question.strip():
            raise RalmInputError("question is empty")
        q = ScriptedGenerator().encode_question(question)
        if len(q) > self.max_prompt_tokens:
            raise RalmInputError(f"question is {len(q)} tokens long; the limit is {self.max_prompt_tokens} tokens")
        return q

    def chat_prompt(self, messages: list) -> str:
        return chat_prompt(None, messages)  # the scripted model has no chat template

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """A deterministic unit vector per text (4-d), and its word count."""
        self.embedded.append(list(texts))
        vecs = np.array([[len(t), t.count(" "), sum(map(ord, t)) % 97, 1.0] for t in texts], dtype=np.float32)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True), [len(t.split()) for t in texts]

    def _result(self, job: RalmJob, on_commit=None) -> RalmResult:
        self.jobs.append(job)
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        return answer(job.question, job, on_commit)

    async def run(self, job: RalmJob) -> RalmResult:
        return await asyncio.to_thread(self._result, job)

    async def stream(self, job: RalmJob) -> AsyncIterator[dict]:
        """Each committed step as a chunk, as a coordinator streams them."""
        commits: list[list[int]] = []
        try:
            res = await asyncio.to_thread(self._result, job, lambda toks: commits.append(list(toks)))
            gen, text = ScriptedGenerator(), ""
            done: list[int] = []
            for toks in commits:
                done += toks
                full = gen.decode(done)
                yield {"delta": full[len(text) :], "tokens": toks}
                text = full
            yield {"delta": "", "tokens": [], "done": True, "result": res}
        finally:
            self.closed_streams += 1

    async def health(self) -> dict:
        if self.unhealthy:
            raise BackendUnavailable(self.unhealthy)
        return {"pool": {"size": 1}}

    async def stats(self) -> dict:
        return {"pool": {"size": 1}, "verifiers": {"edr": {"submissions": len(self.jobs)}}}

    async def configure_verifiers(self, policy: dict, reset_stats: bool = False) -> dict:
        self.policies.append((policy, reset_stats))
        return {"edr": {k: v for k, v in policy.items() if v is not None}}


def settings(**over) -> IngressSettings:
    base = dict(
        model_name=MODEL,
        model_ids=(MODEL, "/models/scripted-lm"),
        retrievers=("edr", "sr"),
        default_method="spec",
        spec_defaults=SpecConfig.named("PSA"),
        request_defaults=REQ,
        knn_defaults=KnnLMConfig(),
        max_prompt_chars=1000,
        max_body_bytes=LIMIT,
        admin=True,
        embedding_model="scripted-encoder",
        embedding_ids=("scripted-encoder", "local:scripted-encoder"),
    )
    return IngressSettings(**{**base, **over})


@pytest.fixture
def backend() -> InProcessBackend:
    return InProcessBackend()


@pytest.fixture
def client(backend) -> TestClient:
    with TestClient(build_http_app(backend, settings())) as c:
        yield c


@pytest.fixture
def keyed(backend) -> TestClient:
    with TestClient(build_http_app(backend, settings(api_key=KEY))) as c:
        yield c


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- auth and body size
def test_missing_or_wrong_key_is_401_and_health_stays_open(keyed):
    err = _error(keyed.post("/v1/ralm/generate", json={"question": QUESTION}), 401)
    assert err["code"] == "missing_api_key" and "Authorization: Bearer" in err["message"]
    for header in (f"Bearer {KEY}x", "Bearer", f"Basic {KEY}", KEY):
        r = keyed.post("/v1/ralm/generate", json={"question": QUESTION}, headers={"Authorization": header})
        assert _error(r, 401)["code"] == "invalid_api_key" and KEY not in r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/healthz").status_code == 200
    r = keyed.post("/v1/ralm/generate", json={"question": QUESTION}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text


def test_the_api_key_never_reaches_the_logs(backend, caplog):
    import logging

    with caplog.at_level(logging.DEBUG), TestClient(build_http_app(backend, settings(api_key=KEY))) as c:
        assert c.post("/v1/ralm/generate", json={"question": QUESTION}).status_code == 401
        wrong = c.post(
            "/v1/ralm/generate", json={"question": QUESTION}, headers={"Authorization": "Bearer " + KEY[:-1]}
        )
        assert wrong.status_code == 401 and KEY[:-1] not in wrong.text
        ok = c.post("/v1/ralm/generate", json={"question": QUESTION}, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and KEY not in ok.text
        backend.fail = RuntimeError("boom")
        c.post("/v1/ralm/generate", json={"question": QUESTION}, headers={"Authorization": f"Bearer {KEY}"})
    assert caplog.records  # the requests were logged (the failure at least) ...
    assert not any(KEY[:8] in r.getMessage() or KEY[:8] in (r.exc_text or "") for r in caplog.records)  # ... without it


def test_cors_is_off_by_default(client):
    """No CORS headers: a browser page of another origin cannot call the API."""
    pre = client.options(
        "/v1/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in pre.headers
    r = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_oversized_bodies_are_413_before_parsing(client):
    err = _error(client.post("/v1/ralm/generate", json={"question": "x" * (LIMIT + 10)}), 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    r = client.post("/v1/completions", content=b"{" * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks():  # no Content-Length: counted while reading
        for _ in range(LIMIT // 512 + 2):
            yield b" " * 512

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert (
        client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}).status_code
        == 400
    )


# ---------------------------------------------------------------- validation
BAD = [
    # (body, status, param, message fragment)
    ({"max_tokens": 5}, 400, "prompt", "'prompt' is required"),
    ({"prompt": 42}, 400, "prompt", "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be between 1 and 64"),
    ({"prompt": "hi", "retreiver": "edr"}, 400, "retreiver", "unknown field 'retreiver'"),
    ({"prompt": "hi", "spec": {"warp": True}}, 400, "spec", "unknown field 'spec.warp'"),
    ({"prompt": "hi", "spec": {"stride": 0}}, 400, "stride", "stride"),
    ({"prompt": "hi", "method": "magic"}, 400, "method", "'seq', 'spec', 'knnlm-seq' or 'knnlm-spec'"),
    ({"prompt": "hi", "method": "knnlm-seq"}, 400, "method", "knnlm is not enabled on this server"),
    ({"prompt": "hi", "retriever": "adr"}, 400, "retriever", "this server serves edr, sr"),
    ({"prompt": "hi", "drafting": "dense"}, 400, "drafting", "dense drafting is not enabled"),
    ({"prompt": "hi", "temperature": 0.8}, 400, "temperature", "greedy"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "exactly one prompt"),
    ({"prompt": "   "}, 400, "prompt", "prompt: question is empty"),
    ({"prompt": "word " * 50}, 400, "prompt", "tokens long; the limit is 40 tokens"),
    ({"prompt": "x" * 1001}, 400, "prompt", "characters long; the limit is 1000 characters"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("body,status,param,fragment", BAD, ids=[json.dumps(b)[:40] for b, *_ in BAD])
def test_bad_requests_get_an_error_naming_the_field(client, backend, body, status, param, fragment):
    err = _error(client.post("/v1/completions", json=body), status)
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"
    assert backend.jobs == []  # refused before the backend saw it


def test_bad_json_and_headers(client):
    for raw in (b"{not json", b"", b"[1, 2]"):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], raw
    err = _error(client.post("/v1/ralm/generate", json={"question": "hi"}, headers={"X-Request-ID": "a b"}), 400)
    assert err["param"] == "X-Request-ID"
    assert client.get("/v1/nothing-here").status_code == 404


# ---------------------------------------------------------------- answers
def test_completions_have_the_openai_shape_and_the_statistics(client, backend):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": QUESTION, "method": "seq"})
    body = r.json()
    assert r.status_code == 200, r.text
    expected = answer(QUESTION, backend.jobs[0])
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert body["choices"] == [
        {"text": expected.text, "index": 0, "logprobs": None, "finish_reason": expected.finish_reason}
    ]
    n_prompt = len(QUESTION.split())
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(expected.tokens),
        "total_tokens": n_prompt + len(expected.tokens),
    }
    ralm = body["ralm"]
    assert (ralm["retriever"], ralm["method"], ralm["exact"]) == ("edr", "seq", True)
    assert ralm["tokens"] == expected.tokens and len(ralm["tokens"]) == REQ.max_new_tokens
    assert ralm["stats"]["doc_ids"] == expected.stats.doc_ids and ralm["stats"]["method"] == "seq"
    # the other accepted model id, a one-element prompt list, echo
    r = client.post(
        "/v1/completions",
        json={"model": "/models/scripted-lm", "prompt": [QUESTION], "echo": True, "max_tokens": 6, "method": "seq"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == QUESTION + answer(QUESTION, backend.jobs[1]).text


def test_generate_carries_stats_and_the_job_built_from_the_server_defaults(client, backend):
    r = client.post(
        "/v1/ralm/generate",
        json={"question": QUESTION, "retriever": "sr", "spec": "PS", "max_new_tokens": 9},
        headers={"X-Request-ID": "req-1"},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    job = backend.jobs[0]
    assert (job.retriever, job.method, job.request.max_new_tokens, job.request_id) == ("sr", "spec", 9, "req-1")
    assert job.spec.prefetch and not job.spec.async_verify
    assert (out["model"], out["retriever"], out["method"], out["request_id"]) == (MODEL, "sr", "spec", "req-1")
    assert out["prompt_tokens"] == len(QUESTION.split()) and out["exact"] is True
    seq = answer(QUESTION, job.model_copy(update={"method": "seq"}))
    assert out["tokens"] == seq.tokens and out["stats"]["doc_ids"] == seq.stats.doc_ids  # RaLMSpec == RaLMSeq
    assert out["stats"]["method"] == "spec[PS]" and out["stats"]["retriever"] == "sr"


def test_backend_errors_are_mapped(client, backend):
    backend.fail = RalmInputError("question has no tokens")
    err = _error(client.post("/v1/ralm/generate", json={"question": QUESTION}), 400)
    assert err["message"] == "question has no tokens"
    backend.fail = ConfigError("unknown retriever 'x'")
    assert _error(client.post("/v1/ralm/generate", json={"question": QUESTION}), 400)["message"].startswith("unknown")
    backend.fail = RuntimeError("boom")
    err = _error(client.post("/v1/ralm/generate", json={"question": QUESTION}), 500)
    assert err["type"] == "server_error" and err["message"] == "internal error: boom"
    stats = client.get("/v1/ralm/stats").json()
    assert (stats["requests"], stats["errors"]) == (3, 3)
    assert client.post("/v1/ralm/generate", json={"question": QUESTION}).status_code == 200


class SlowBackend(InProcessBackend):
    """A backend whose requests never finish on their own; it records being cancelled."""

    def __init__(self):
        super().__init__()
        self.cancelled = 0

    async def run(self, job: RalmJob) -> RalmResult:
        self.jobs.append(job)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")

    async def stream(self, job: RalmJob) -> AsyncIterator[dict]:
        try:
            yield {"delta": "first", "tokens": [1]}
            await asyncio.sleep(3600)
        finally:
            self.cancelled += 1


def test_a_full_server_answers_503_with_retry_after_and_keeps_serving(client, backend):
    backend.fail = Overloaded("the server is at capacity (16 requests running, 64 waiting); retry later", 7.2)
    r = client.post("/v1/ralm/generate", json={"question": QUESTION})
    err = _error(r, 503)
    assert r.headers["retry-after"] == "8" and err["code"] == "overloaded" and "at capacity" in err["message"]
    backend.fail = Overloaded("full", 0.2)  # a stream shed at admission: a 503 before any event
    r = client.post("/v1/completions", json={"prompt": QUESTION, "stream": True, "method": "seq"})
    assert _error(r, 503)["code"] == "overloaded" and r.headers["retry-after"] == "1"
    assert client.get("/v1/ralm/stats").json()["overloaded"] == 2
    assert client.post("/v1/ralm/generate", json={"question": QUESTION}).status_code == 200


SHED_MESSAGES = [  # every way the backend sheds a request (actors/pool.py, deployments/ray_backend.py)
    ("the server is at capacity (16 requests running, 64 waiting); retry later", 7.2),
    ("no coordinator could be started within 60 s; a node may have been lost, retry later", 1.0),
    ("the request's coordinator was lost 4 times; a node may have been lost, retry later", 60.0),
    ("the coordinator running this stream was lost (a node may have been lost); retry the request", 0.0),
]


@pytest.mark.parametrize("message,after", SHED_MESSAGES, ids=["full", "no-coordinator", "lost", "stream-lost"])
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/ralm/generate", {"question": QUESTION}),
        ("/v1/completions", {"prompt": QUESTION}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]}),
    ],
    ids=["generate", "completions", "chat"],
)
def test_every_shed_answer_carries_retry_after(client, backend, path, body, message, after):
    """A request the server sheds gets 503 with Retry-After (whole seconds, at least 1) on
    every route, streamed or not (a stream is admitted before its headers are sent); the
    server keeps serving."""
    backend.fail = Overloaded(message, after)
    r = client.post(path, json=body)
    err = _error(r, 503)
    assert err["code"] == "overloaded" and err["message"] == message
    assert r.headers["retry-after"] == str(max(1, math.ceil(after)))
    if "prompt" in body or "messages" in body:  # the OpenAI routes stream
        backend.fail = Overloaded(message, after)
        r = client.post(path, json={**body, "stream": True})
        err = _error(r, 503)
        assert err["code"] == "overloaded" and err["message"] == message
        assert r.headers["retry-after"] == str(max(1, math.ceil(after)))
    assert client.post(path, json=body).status_code == 200


def test_an_unhealthy_server_answers_503_with_retry_after(client, backend):
    backend.unhealthy = "verifier: ActorDiedError"
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json() == {"status": "unhealthy", "reason": "verifier: ActorDiedError"}
    assert r.headers["retry-after"] == str(math.ceil(C.SHED_RETRY_AFTER_S))
    backend.unhealthy = None
    assert client.get("/healthz").status_code == 200


class SheddingBackend(InProcessBackend):
    """Sheds its first requests (``sheds``: the :class:`Overloaded` each raises), then answers."""

    def __init__(self, sheds: list[Overloaded]):
        super().__init__()
        self.sheds = list(sheds)

    def _result(self, job: RalmJob, on_commit=None) -> RalmResult:
        if self.sheds:
            self.fail = self.sheds.pop(0)
        return super()._result(job, on_commit)


def test_a_client_retrying_shed_answers_gets_every_answer():
    """The clients' retry (cluster/http_retry.py: soak, served-bench, the fault tests) against
    the real app: a request shed twice is answered on its third send, after the two waits the
    server asked for, with the answer it would have had at once."""
    from cluster.http_retry import send_with_retry

    backend = SheddingBackend([Overloaded("full", 2.0), Overloaded("no coordinator could be started", 0.3)])
    waits: list[float] = []
    with TestClient(build_http_app(backend, settings())) as c:
        res = send_with_retry(lambda: c.post("/v1/ralm/generate", json={"question": QUESTION}), sleep=waits.append)
    assert res.response.status_code == 200 and res.retries == 2 and waits == [2.0, 1.0] and not res.gave_up
    assert res.response.json()["tokens"] == answer(QUESTION, backend.jobs[-1]).tokens
    assert [r.split(" ", 1)[0] for r in res.reasons] == ["503", "503"] and "full" in res.reasons[0]


def test_a_request_past_its_deadline_is_cancelled_and_answered_504():
    slow = SlowBackend()
    with TestClient(build_http_app(slow, settings(request_timeout_s=0.3))) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"prompt": QUESTION, "max_tokens": 8})
        assert time.perf_counter() - t0 < 5
        err = _error(r, 504)
        assert err["code"] == "timeout" and "deadline of 0.3 s" in err["message"]
        assert slow.cancelled == 1  # the backend's work was cancelled, not left running
        events = _events(c, {"method": "seq"})  # a stream: its first chunk, then the timeout
        assert json.loads(events[0])["choices"][0]["text"] == "first"
        assert json.loads(events[-1])["error"]["code"] == "timeout"
        assert slow.cancelled == 2
        assert c.get("/v1/ralm/stats").json()["timeouts"] == 2


# ---------------------------------------------------------------- streaming
def _events(client, body: dict) -> list[str]:
    with client.stream("POST", "/v1/completions", json={"prompt": QUESTION, "stream": True, **body}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["cache-control"] == "no-cache"
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] for line in lines]


def test_streaming_sends_server_sent_events(client, backend):
    events = _events(client, {"method": "seq", "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    expected = answer(QUESTION, backend.jobs[0])
    assert len(objs) >= 3  # one chunk per committed step, then the last
    assert "".join(o["choices"][0]["text"] for o in objs) == expected.text
    assert all(o["object"] == "text_completion" and o["model"] == MODEL for o in objs)
    assert len({o["id"] for o in objs}) == 1
    assert [o["choices"][0]["finish_reason"] for o in objs[:-1]] == [None] * (len(objs) - 1)
    last = objs[-1]
    assert last["choices"][0]["finish_reason"] == expected.finish_reason
    assert last["ralm"]["tokens"] == expected.tokens and last["ralm"]["stats"]["doc_ids"] == expected.stats.doc_ids
    assert last["usage"]["completion_tokens"] == len(expected.tokens)
    assert "usage" not in json.loads(_events(client, {"method": "seq"})[-2])
    echo = [json.loads(e) for e in _events(client, {"method": "seq", "echo": True})[:-1]]
    assert echo[0]["choices"][0]["text"] == QUESTION
    assert backend.closed_streams == 3


class MidStreamBackend(InProcessBackend):
    """Streams one chunk, then raises ``after`` (an error once the response has started)."""

    def __init__(self, after: Exception):
        super().__init__()
        self.after = after

    async def stream(self, job: RalmJob) -> AsyncIterator[dict]:
        try:
            yield {"delta": "first", "tokens": [1]}
            raise self.after
        finally:
            self.closed_streams += 1


def test_a_stream_that_fails_before_its_first_chunk_gets_an_http_error(client, backend):
    """Refused before anything was sent: the status a non-streamed request gets, not a 200."""
    backend.fail = RalmInputError("question has no tokens")
    r = client.post("/v1/completions", json={"prompt": QUESTION, "stream": True, "method": "seq"})
    assert _error(r, 400)["message"] == "question has no tokens"
    backend.fail = RuntimeError("boom")
    r = client.post("/v1/completions", json={"prompt": QUESTION, "stream": True})
    assert _error(r, 500)["type"] == "server_error"
    assert client.get("/v1/ralm/stats").json()["errors"] == 2
    assert backend.closed_streams == 2  # both backend streams were closed


@pytest.mark.parametrize(
    "error,type_,extra",
    [
        (RalmInputError("question has no tokens"), "invalid_request_error", {}),
        (RuntimeError("boom"), "server_error", {}),
        (
            Overloaded("the coordinator running this stream was lost; retry the request", 2.5),
            "overloaded_error",
            {"retry_after": "3"},
        ),
    ],
    ids=["input", "internal", "shed"],
)
def test_a_stream_that_fails_after_it_started_ends_with_an_error_event(error, type_, extra):
    """Once the first chunk went out, an error is the stream's last event (a shed one says when to retry)."""
    backend = MidStreamBackend(error)
    with TestClient(build_http_app(backend, settings())) as c:
        events = _events(c, {"method": "seq"})
    assert json.loads(events[0])["choices"][0]["text"] == "first"
    err = json.loads(events[-1])["error"]
    assert err["type"] == type_ and all(err[k] == v for k, v in extra.items())
    assert backend.closed_streams == 1


def test_a_stream_the_client_leaves_is_closed(backend):
    """The client goes away after the first chunk: the backend's stream is closed (the request cancelled)."""
    ep = build_http_app(backend, settings()).state.endpoints
    job = RalmJob(question=QUESTION, retriever="edr", method="seq", request=REQ)

    async def leave_early():
        resp = await ep._stream_response(job, lambda text, finish, **extra: f"data: {text}\n\n", None, 5, False)
        first = await resp.body_iterator.__anext__()
        await resp.body_iterator.aclose()
        return first

    assert asyncio.run(leave_early()).startswith("data: ")
    assert backend.closed_streams == 1


# ---------------------------------------------------------------- other endpoints
def test_models_health_stats_and_admin(client, backend):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["retrievers"] == ["edr", "sr"] and models["data"][0]["features"] == backend.features
    health = client.get("/healthz").json()
    assert (health["status"], health["model"], health["pool"]) == ("ok", MODEL, {"size": 1})
    backend.unhealthy = "verifier: TimeoutError"
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json() == {"status": "unhealthy", "reason": "verifier: TimeoutError"}
    stats = client.get("/v1/ralm/stats").json()
    assert set(stats) == {"requests", "errors", "overloaded", "timeouts", "pool", "verifiers", "features"}
    out = client.post("/v1/ralm/admin/verifier", json={"batching": False, "reset_stats": True}).json()
    assert out == {"edr": {"batching": False}}
    assert backend.policies[0] == (
        {
            "batching": False,
            "window_ms": None,
            "max_batch": None,
            "max_inflight": None,
            "flush_when_all_waiting": None,
            "wait_for_speculating": None,
        },
        True,
    )
    err = _error(client.post("/v1/ralm/admin/verifier", json={"max_inflight": 0}), 400)
    assert err["param"] == "max_inflight"
    assert (
        _error(client.post("/v1/ralm/admin/verifier", content=b"{x"), 400)["message"]
        == "request body is not valid JSON"
    )


def test_admin_is_off_unless_enabled(backend):
    with TestClient(build_http_app(backend, settings(admin=False))) as c:
        assert _error(c.post("/v1/ralm/admin/verifier", json={"batching": False}), 403)["code"] == "forbidden"
    assert backend.policies == []


def test_settings_from_the_app_config():
    from deployments.config import AppConfig

    cfg = AppConfig.model_validate(
        {
            "retrievers": ["sr", "edr"],
            "default_method": "seq",
            "ingress": {"served_model_name": "m", "admin": True, "max_body_bytes": 10},
        }
    )
    s = IngressSettings.from_config(cfg, api_key="k")
    assert (s.model_name, s.retrievers, s.default_method, s.admin, s.max_body_bytes, s.api_key) == (
        "m",
        ("sr", "edr"),
        "seq",
        True,
        10,
        "k",
    )
    assert s.model_ids == ("m", str(cfg.ralm.generator.model)) and s.request_defaults == cfg.ralm.request


def test_the_http_layer_imports_no_ray():
    """A fresh interpreter imports the ingress, the backend protocol and this module without Ray."""
    code = (
        "import sys; import deployments.ingress, deployments.backend, tests.deployments.test_ingress_http; "
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')); assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_concurrent_requests_are_answered_independently(client, backend):
    out: dict = {}

    def one(i: int):
        r = client.post("/v1/ralm/generate", json={"question": QUESTION + " x" * i, "method": "seq"})
        out[i] = r.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert (
            out[i]["tokens"] == answer(QUESTION + " x" * i, backend.jobs[0].model_copy(update={"method": "seq"})).tokens
        )


def test_generate_answers_in_its_documented_shape_with_the_prompt_counted_once(client, backend):
    """The body of /v1/ralm/generate, key by key (docs/api.md), built from the backend's
    frozen result; the question is tokenised once, by the ingress that validates it."""
    calls: list[str] = []
    encode = backend.encode_question
    backend.encode_question = lambda q: calls.append(q) or encode(q)
    r = client.post("/v1/ralm/generate", json={"question": QUESTION, "method": "seq"})
    assert r.status_code == 200, r.text
    out = r.json()
    keys = ["model", "retriever", "method", "request_id", "text", "tokens", "finish_reason", "exact", "stats"]
    assert list(out) == [*keys, "prompt_tokens"]
    expected = answer(QUESTION, backend.jobs[0]).as_dict()  # a second run: the same but for its timings
    assert {k: out[k] for k in keys[4:8]} == {k: expected[k] for k in keys[4:8]}
    assert list(out["stats"]) == list(expected["stats"]) and out["stats"]["doc_ids"] == expected["stats"]["doc_ids"]
    assert calls == [QUESTION] and out["prompt_tokens"] == len(QUESTION.split())
