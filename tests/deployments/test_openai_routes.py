"""``/v1/chat/completions`` and ``/v1/embeddings`` over the in-process backend (no Ray):
OpenAI shapes, streaming, exactness against the completion of the same prompt, and the
clear 4xx of every unsupported or malformed field. The real model's chat template and the
official client over Ray Serve are tested in ``test_http.py`` and ``test_http_smollm2.py``."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from deployments.ingress import build_http_app
from tests.deployments.test_ingress_http import MODEL, QUESTION, InProcessBackend, answer, settings


@pytest.fixture
def backend() -> InProcessBackend:
    return InProcessBackend()


@pytest.fixture
def client(backend) -> TestClient:
    with TestClient(build_http_app(backend, settings())) as c:
        yield c


def _chat(client, messages=None, **extra):
    body = {"model": MODEL, "messages": messages or [{"role": "user", "content": QUESTION}], **extra}
    return client.post("/v1/chat/completions", json=body)


def test_chat_is_the_completion_of_the_rendered_prompt(client, backend):
    r = _chat(client, method="seq")
    assert r.status_code == 200, r.text
    body = r.json()
    expected = answer(QUESTION, backend.jobs[0])  # no chat template: one user message = the prompt itself
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": expected.text},
            "logprobs": None,
            "finish_reason": expected.finish_reason,
        }
    ]
    assert body["ralm"]["tokens"] == expected.tokens and body["ralm"]["prompt"] == QUESTION
    assert body["usage"]["completion_tokens"] == len(expected.tokens)
    comp = client.post("/v1/completions", json={"prompt": QUESTION, "method": "seq"}).json()
    assert comp["ralm"]["tokens"] == body["ralm"]["tokens"]
    # the retrieval options ride along; speculation returns the same tokens
    r = _chat(client, spec="PSA", retriever="edr")
    assert r.status_code == 200 and r.json()["ralm"]["tokens"] == expected.tokens
    assert backend.jobs[-1].method == "spec"
    # a system message and text parts: contents joined by blank lines (no template)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what does "}, {"type": "text", "text": "json do"}]},
    ]
    r = _chat(client, msgs, max_completion_tokens=4)
    assert r.status_code == 200, r.text
    assert backend.jobs[-1].question == "be brief\n\nwhat does json do"
    assert r.json()["usage"]["completion_tokens"] == 4


def test_chat_streaming_deltas_concatenate_to_the_answer(client, backend):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "method": "seq",
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    expected = answer(QUESTION, backend.jobs[0])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == expected.text
    assert len([e for e in events if e["choices"][0]["delta"].get("content")]) >= 2  # incremental
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == expected.finish_reason and last["choices"][0]["delta"] == {}
    assert last["usage"]["completion_tokens"] == len(expected.tokens) and last["ralm"]["tokens"] == expected.tokens


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": []}, 400, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role must be one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "text parts"),
        ({"messages": [{"role": "user", "content": 42}]}, 400, "string or a list"),
        ({"messages": ["hello"]}, 400, "must be an object"),
        ({"messages": [{"role": "user", "content": "   "}]}, 400, "empty"),
        ({"messages": [{"role": "user", "content": "x" * 1001}]}, 400, "limit is 1000 characters"),
        ({"n": 2}, 400, "n=1"),
        ({"temperature": 0.7}, 400, "greedy"),
        ({"logprobs": True}, 400, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool calling"),
        ({"response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "disagree"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
        ({"model": "gpt-4"}, 404, "does not exist"),
        ({"bogus": 1}, 400, "unknown field 'bogus'"),
        ({"retriever": "nope"}, 400, "unknown retriever"),
    ],
)
def test_chat_bad_requests_are_clear_400s(client, backend, body, status, needle):
    full = {"messages": [{"role": "user", "content": QUESTION}], **body}
    r = client.post("/v1/chat/completions", json=full)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert backend.jobs == []  # refused before any work
    assert _chat(client, method="seq").status_code == 200  # and the server keeps serving


def test_embeddings_float_and_base64_agree(client, backend):
    texts = ["what does json dumps do", "posixpath join"]
    r = client.post("/v1/embeddings", json={"model": "scripted-encoder", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "scripted-encoder"
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    want = np.array([[len(t), t.count(" "), sum(map(ord, t)) % 97, 1.0] for t in texts], dtype=np.float32)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.array_equal(got, want)
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    r = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    b64 = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    assert np.array_equal(np.stack(b64), want)
    # one string, the long model id, the right dimensions
    r = client.post("/v1/embeddings", json={"input": texts[0], "model": "local:scripted-encoder", "dimensions": 4})
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert backend.embedded == [texts, texts, texts[:1]]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"input": []}, 400, "must not be empty"),
        ({"input": [1, 2, 3]}, 400, "token arrays"),
        ({"input": [[1, 2]]}, 400, "token arrays"),
        ({"input": ["ok", ""]}, 400, "input[1]"),
        ({"input": ["x" * 1001]}, 400, "limit is 1000"),
        ({"input": ["a"] * 257}, 400, "at most 256"),
        ({"input": "a", "model": "text-embedding-3-small"}, 404, "does not exist"),
        ({"input": "a", "dimensions": 8}, 400, "4-dimensional"),
        ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": 5}, 400, "input"),
    ],
)
def test_embeddings_bad_requests(client, body, status, needle):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_embeddings_without_a_dense_retriever(backend):
    with TestClient(build_http_app(backend, settings(retrievers=("sr",), embedding_model=None))) as c:
        r = c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "dense retriever" in r.json()["error"]["message"]
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == [MODEL]
    assert backend.embedded == []


def test_models_lists_the_embedding_model(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [MODEL, "scripted-encoder"]
