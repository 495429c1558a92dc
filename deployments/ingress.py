"""The HTTP front end: :func:`build_http_app` makes the FastAPI app over a backend.

Endpoints:

- ``POST /v1/completions`` - OpenAI-compatible completions (``prompt``, ``max_tokens``,
  ``stream`` with server-sent events, ``echo``). Retrieval options are extra fields:
  ``retriever`` (edr|adr|sr), ``method`` (seq|spec|knnlm-seq|knnlm-spec, see
  :mod:`ralm.methods`), ``spec`` (a configuration name such as ``"PSA"``/``"base"``, or an
  object of :class:`~ralm.config.SpecConfig` fields), ``stride``, ``prefetch_size``, and the
  generation-side modes of :class:`~ralm.config.RequestConfig` (``num_docs``, ``drafting``
  and its ``ngram_*``/``dense_*`` knobs, ``workload`` with ``flare_threshold`` /
  ``iter_retgen_iterations``, ``idgr``, ``allow_inexact_shifted_reuse``, ...) and ``knn``
  (KNN-LM options); see :class:`deployments.api.RalmOptions`. The response carries the
  request's statistics and ``exact`` under ``ralm``.
- ``POST /v1/chat/completions`` - OpenAI chat: ``messages`` rendered by the generator's chat
  template, then the same job as a completion (same options, streaming, exactness); see
  :mod:`deployments.openai_routes`.
- ``POST /v1/embeddings`` - the dense retrievers' encoder (float or base64 vectors).
- ``GET /v1/models`` - the served model (and the optional modes it serves, ``features``),
  and the embedding model when a dense retriever is served.
- ``POST /v1/ralm/generate`` - native: ``question`` + the same options, returns text,
  tokens, finish reason, ``exact`` (false when an inexact option - IDGR, shifted doc-KV
  reuse - was on) and :meth:`~ralm.results.RequestStats.as_dict`.
- ``GET /v1/ralm/stats`` - coordinator pool, verifiers (batching) and generator (its
  continuous batching: ``generator.batching``).
- ``POST /v1/ralm/admin/verifier`` - change the verifiers' batching policy (``ingress.admin``).
- ``GET /healthz``.

Decoding is greedy (that is what makes RaLMSpec exact), so sampling parameters other
than their greedy values are rejected. Every invalid request gets a 4xx answer with an
OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``, and the
server keeps serving.

Security: when ``RALMSPEC_API_KEY`` (or a file named by ``RALMSPEC_API_KEY_FILE``, e.g. a
mounted Kubernetes Secret) is set in the ingress's environment, every endpoint except
``/healthz`` needs ``Authorization: Bearer <key>`` (401 otherwise); the key is never read
from the config file. Bodies above ``ingress.max_body_bytes`` get 413 before they are
parsed, and a body that takes longer than ``ingress.body_timeout_s`` to arrive gets 408.

This module is HTTP only: the app, auth, body limits, error mapping; the handlers are in
:mod:`deployments.endpoints` and :mod:`deployments.openai_routes`. The work is
done by a :class:`~deployments.backend.RalmBackend` (served: the Ray topology of
:mod:`deployments.ray_backend`, wrapped as a Serve deployment in
:mod:`deployments.serve_ingress`), so the app can be built and tested without Ray.
"""

# no "from __future__ import annotations": FastAPI must see the body models as classes
import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import cast

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import openai_routes
from deployments.api import (
    ApiError,
    ChatCompletionRequest,
    EmbeddingRequest,
    describe,
    error_body,
)
from deployments.backend import RalmBackend
from deployments.drain import Drain, DrainMiddleware
from deployments.endpoints import Endpoints, IngressSettings

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ API key and body size
API_KEY_ENV = "RALMSPEC_API_KEY"
API_KEY_FILE_ENV = "RALMSPEC_API_KEY_FILE"
OPEN_PATHS = frozenset({"/healthz"})


def read_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key from ``RALMSPEC_API_KEY`` or the file named by ``RALMSPEC_API_KEY_FILE``
    (None: no key, the API is open). Never from a config file."""
    env = os.environ if environ is None else environ
    key, path = env.get(API_KEY_ENV), env.get(API_KEY_FILE_ENV)
    if key and path:
        raise ValueError(f"both {API_KEY_ENV} and {API_KEY_FILE_ENV} are set; set only one")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                key = fh.read().strip()
        except OSError as e:
            raise ValueError(
                f"cannot read the API key file named by {API_KEY_FILE_ENV} ({path}): {e.strerror}"
            ) from None
        if not key:
            raise ValueError(f"the API key file {path} is empty")
    return key.strip() if key else None


class GuardMiddleware:
    """ASGI middleware: bearer-token check (when a key is set) and a request body size limit
    (checked on Content-Length and while reading, before the JSON is parsed)."""

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = 1_048_576, body_timeout_s: float = 30.0):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    @staticmethod
    async def _reply(send, status: int, message: str, code: str, headers: list | None = None) -> None:
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or []),
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        key = self.api_key
        if key and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if not auth:
                return await self._reply(
                    send,
                    401,
                    "missing API key: send the header 'Authorization: Bearer <key>'",
                    "missing_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return await self._reply(
                    send,
                    401,
                    "invalid API key",
                    "invalid_api_key",
                    [(b"www-authenticate", b'Bearer error="invalid_token"')],
                )
        limit = self.max_body_bytes
        too_big = (f"request body is larger than the limit of {limit} bytes", "request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await self._reply(send, 400, "invalid Content-Length header", "invalid_request")
            if n > limit:
                return await self._reply(send, 413, *too_big)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        # read the body (at most limit bytes, within body_timeout_s), then hand it on in one message
        chunks, total = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await self._reply(
                    send,
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s (ingress.body_timeout_s)",
                    "body_timeout",
                    [(b"connection", b"close")],
                )
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([msg], receive), send)
            body = msg.get("body", b"")
            total += len(body)
            if total > limit:
                return await self._reply(send, 413, *too_big)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = (
            json_problem(body) if body and headers.get(b"content-type", b"").startswith(b"application/json") else None
        )
        if problem is not None:
            return await self._reply(send, 400, problem, "invalid_json")
        first = {"type": "http.request", "body": body, "more_body": False}
        return await self.app(scope, _replay([first], receive), send)


def json_problem(body: bytes) -> str | None:
    """Why ``body`` is not a JSON document, precisely (None when it is one).

    FastAPI's own parser answers every one of these with "There was an error parsing the
    body"; a client fixing its request needs to know which: ``json_problem(b"\\xff")`` ->
    ``"request body is not valid UTF-8 (byte 0)"``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"request body is not valid UTF-8 (byte {e.start})"
    try:
        json.loads(text)
    except RecursionError:
        return "request body is not valid JSON: it is nested too deeply"
    except json.JSONDecodeError as e:
        return f"request body is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
    except ValueError as e:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        if "digits" in str(e):
            return "request body is not valid JSON: a number has too many digits"
        return f"request body is not valid JSON ({e})"
    return None


def _replay(messages: list, receive):
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


# ------------------------------------------------------------------ error mapping
# Starlette types every handler as taking any Exception; each is registered for one class
# only (build_http_app), so the cast names the class Starlette passes.
async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    e = cast(ApiError, exc)
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in the API's error format."""
    e = cast(StarletteHTTPException, exc)
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(
        error_body(str(e.detail), "invalid_request_error", None, code),
        status_code=e.status_code,
        headers=getattr(e, "headers", None),
    )


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    e = cast(RequestValidationError, exc)
    msg, param = describe(list(e.errors()))
    return JSONResponse(error_body(msg, param=param), status_code=400)


def build_http_app(backend: RalmBackend, settings: IngressSettings, drain: Drain | None = None) -> FastAPI:
    """The FastAPI app of the ralmspec HTTP API over ``backend`` (no Ray needed); with
    ``drain``, the app answers 503 once it drains (:mod:`deployments.drain`)."""
    app = FastAPI(
        title="ralmspec",
        version="0.1.0",
        description="Iterative retrieval-augmented LM serving with exact speculative retrieval.",
    )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    if drain is not None:  # added last: the outermost layer, before auth and body limits
        app.add_middleware(DrainMiddleware, drain=drain)
    ep = Endpoints(backend, settings)
    app.state.endpoints = ep
    app.get("/healthz")(ep.healthz)
    app.get("/v1/models")(ep.models)
    app.get("/v1/ralm/stats")(ep.stats)
    app.post("/v1/ralm/admin/verifier")(ep.admin_verifier)
    app.post("/v1/ralm/generate")(ep.generate)
    app.post("/v1/completions")(ep.completions)

    async def chat(body: ChatCompletionRequest, x_request_id: str | None = Header(None)):
        return await openai_routes.chat_completions(ep, body, x_request_id)

    async def embed(body: EmbeddingRequest):
        return await openai_routes.embeddings(ep, body)

    app.post("/v1/chat/completions")(chat)
    app.post("/v1/embeddings")(embed)
    return app


__all__ = [
    "API_KEY_ENV",
    "API_KEY_FILE_ENV",
    "Endpoints",
    "GuardMiddleware",
    "IngressSettings",
    "build_http_app",
    "read_api_key",
]
