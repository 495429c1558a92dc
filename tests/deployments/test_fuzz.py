"""Hostile input over real HTTP: schemathesis against the OpenAPI schema, and hand-written
cases (unicode and NUL bytes, invalid UTF-8, JSON nested 10,000 deep, 1,000-digit numbers,
a 100 MB body, a body trickled slower than the body deadline, unknown models, bad
``max_tokens``). Each must get a clear 4xx (never a 5xx, never a hang), and the server must
answer a normal request afterwards.

The app is the real HTTP layer (auth, limits, validation, routes) served by uvicorn on a
local port, over the in-process backend that runs the core loops on scripted parts (no Ray:
what is fuzzed here is the HTTP surface; the served topology's own HTTP tests are in
``test_http.py``)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from deployments.ingress import build_http_app
from tests.deployments.serving import free_port, run_schemathesis
from tests.deployments.test_ingress_http import QUESTION, InProcessBackend, settings

BODY_TIMEOUT_S = 1.5
MAX_BODY = 1_048_576  # the production default (ingress.max_body_bytes)


@pytest.fixture(scope="module")
def live():
    uvicorn = pytest.importorskip("uvicorn")
    backend = InProcessBackend()
    app = build_http_app(backend, settings(body_timeout_s=BODY_TIMEOUT_S, max_body_bytes=MAX_BODY))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "backend": backend}
    server.should_exit = True
    th.join(timeout=10)


def _normal_request_works(url: str) -> None:
    r = httpx.post(url + "/v1/ralm/generate", json={"question": QUESTION, "method": "seq"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"], "an empty answer"


def _raw(port: int, head: bytes, body_parts=(), pause_s: float = 0.0, read_timeout: float = 30.0) -> tuple[int, bytes]:
    """Send a hand-made HTTP/1.1 request (headers, then body parts with pauses); the status and
    the whole response. Stops sending when the server has answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(head)
        s.settimeout(0.01)
        got = b""
        for part in body_parts:
            try:
                got += s.recv(65536)
            except (TimeoutError, BlockingIOError):
                pass
            if got:
                break  # answered before the body was complete
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
            if pause_s:
                time.sleep(pause_s)
        s.settimeout(read_timeout)
        try:
            while b"\r\n\r\n" not in got:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            head_end = got.index(b"\r\n\r\n") + 4
            length = next(
                (
                    int(v)
                    for k, _, v in (ln.partition(b":") for ln in got[:head_end].split(b"\r\n"))
                    if k.lower() == b"content-length"
                ),
                0,
            )
            while len(got) < head_end + length:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert got.startswith(b"HTTP/1.1 "), got[:200]
    return int(got[9:12]), got


def _post_head(path: str, length: int | None, extra: str = "") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{cl}{extra}\r\n".encode()


@pytest.mark.parametrize(
    "question",
    ["json\u0000dumps", "\u00e9\u00e8 \u4e2d\u6587 \U0001f600 \u202eevil", "\ud7ff\ue000\ufffd", "\x00" * 8],
    ids=["nul", "unicode", "edge-codepoints", "only-nul"],
)
def test_unicode_and_nul_bytes(live, question):
    r = httpx.post(live["url"] + "/v1/ralm/generate", json={"question": question, "method": "seq"}, timeout=30)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert isinstance(r.json()["text"], str)
    _normal_request_works(live["url"])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"question": "caf\xe9 au lait"}', "not valid UTF-8 (byte 17)"),  # latin-1, not UTF-8
        (b'{"question": "\xff\xfe\xfd"}', "not valid UTF-8 (byte 14)"),
        (b"\xc3\x28", "not valid UTF-8 (byte 0)"),
        (b'{"question": "ok",', "not valid JSON (Expecting property name"),
        (b"", "request body is required"),
        (b"[]", "invalid request"),
        (b"null", "invalid request"),
    ],
    ids=["latin1", "garbage-bytes", "bad-2-byte-seq", "truncated", "empty", "array", "null"],
)
def test_invalid_utf8_and_malformed_json(live, body, needle):
    r = httpx.post(
        live["url"] + "/v1/ralm/generate", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    _normal_request_works(live["url"])


@pytest.mark.parametrize("path", ["/v1/ralm/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
def test_json_nested_ten_thousand_deep(live, path):
    for body in (
        ("[" * 10_000 + "]" * 10_000).encode(),
        ('{"question": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000 + "}").encode(),
    ):
        assert len(body) < MAX_BODY
        r = httpx.post(live["url"] + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "request body is not valid JSON: it is nested too deeply"
    _normal_request_works(live["url"])


@pytest.mark.parametrize(
    "field",
    [
        '"max_new_tokens": 1' + "0" * 999,
        '"max_new_tokens": -' + "9" * 1000,
        '"max_new_tokens": 1e400',
        '"stride": 1' + "0" * 5000,
        '"generation_stride": 1.' + "5" * 1000,
    ],
    ids=["1000-digits", "negative-1000-digits", "float-overflow", "5000-digits", "long-fraction"],
)
def test_numbers_with_a_thousand_digits(live, field):
    body = ('{"question": "' + QUESTION + '", ' + field + "}").encode()
    r = httpx.post(live["url"] + "/v1/ralm/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert len(msg) < 300, "the error echoes the whole number back"
    if len(field) > 4300:
        assert "too many digits" in msg, msg
    else:
        assert "max_new_tokens" in msg or "generation_stride" in msg, msg
    _normal_request_works(live["url"])


def test_a_100_mb_body_is_refused_before_it_is_read(live):
    # declared: 413 on the header alone, before any of the body is sent
    t0 = time.monotonic()
    status, resp = _raw(live["port"], _post_head("/v1/ralm/generate", 100 * 1024 * 1024), [b"x" * 65536] * 1600)
    assert status == 413 and b"request_too_large" in resp
    assert time.monotonic() - t0 < 10
    # chunked (no Content-Length): refused once the limit is passed, long before 100 MB
    chunk = b"x" * 65536
    part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    status, resp = _raw(live["port"], _post_head("/v1/ralm/generate", None), [part] * 1600)
    assert status == 413
    _normal_request_works(live["url"])


def test_a_trickled_body_times_out(live):
    body = json.dumps({"question": QUESTION, "method": "seq"}).encode()
    t0 = time.monotonic()
    parts = [body[i : i + 1] for i in range(len(body))]
    status, resp = _raw(live["port"], _post_head("/v1/ralm/generate", len(body)), parts, pause_s=0.25)
    waited = time.monotonic() - t0
    assert status == 408 and b"body_timeout" in resp, resp[:300]
    assert BODY_TIMEOUT_S - 0.1 <= waited < BODY_TIMEOUT_S + 5
    # a body that arrives in time, even in pieces, is served
    status, resp = _raw(live["port"], _post_head("/v1/ralm/generate", len(body)), [body[:10], body[10:]], pause_s=0.2)
    assert status == 200, resp[:300]
    _normal_request_works(live["url"])


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", {"model": "gpt-5", "prompt": QUESTION}, 404, "does not exist"),
        (
            "/v1/chat/completions",
            {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]},
            404,
            "does not exist",
        ),
        ("/v1/completions", {"prompt": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": QUESTION, "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": QUESTION, "max_tokens": 100_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": QUESTION, "max_tokens": "12"}, 400, "max_tokens"),
        ("/v1/ralm/generate", {"question": QUESTION, "max_new_tokens": 0}, 400, "max_new_tokens"),
        ("/v1/ralm/generate", {"question": QUESTION, "max_new_tokens": 10**6}, 400, "max_new_tokens"),
    ],
)
def test_unknown_model_and_bad_max_tokens(live, path, body, status, needle):
    r = httpx.post(live["url"] + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    _normal_request_works(live["url"])


def test_schemathesis_finds_no_server_error(live, tmp_path):
    """schemathesis (property-based, from the OpenAPI schema), every operation, its coverage
    and fuzzing phases: no 5xx, no response slower than 30 s; then a normal request works."""
    cases = run_schemathesis(live["url"], tmp_path, max_examples=100)
    assert cases >= 1000, cases
    _normal_request_works(live["url"])
    assert live["backend"].jobs, "no generated request reached the backend"
