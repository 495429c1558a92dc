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
- ``GET /v1/models`` - the served model (and the optional modes it serves, ``features``).
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
parsed.

This module is HTTP only: routes, auth, validation, streaming, error mapping. The work is
done by a :class:`~deployments.backend.RalmBackend` (served: the Ray topology of
:mod:`deployments.ray_backend`, wrapped as a Serve deployment in
:mod:`deployments.serve_ingress`), so the app can be built and tested without Ray.
"""

# no "from __future__ import annotations": FastAPI must see the body models as classes
import asyncio
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.api import (
    ApiError,
    CompletionRequest,
    GenerateRequest,
    RalmOptions,
    build_job,
    describe,
    error_body,
    message_of,
    verifier_policy_update,
)
from deployments.backend import BackendUnavailable, RalmBackend
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.errors import ConfigError, Overloaded, RalmInputError, RequestCancelled

if TYPE_CHECKING:  # the config module pulls in the generator's (torch); the HTTP layer needs none of it
    from deployments.config import AppConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class IngressSettings:
    """What the HTTP layer needs of the app config (and the API key, from the environment)."""

    model_name: str  # the model id in the OpenAI API
    model_ids: tuple[str, ...]  # ids a request's ``model`` may name
    retrievers: tuple[str, ...]  # served retriever kinds; the first is the default
    default_method: str
    spec_defaults: SpecConfig
    request_defaults: RequestConfig
    knn_defaults: KnnLMConfig
    max_prompt_chars: int = 20_000
    max_body_bytes: int = 1_048_576
    admin: bool = False
    api_key: str | None = None
    request_timeout_s: float = 600.0  # 0: no deadline

    @classmethod
    def from_config(cls, cfg: "AppConfig", api_key: str | None = None) -> "IngressSettings":
        """The settings of a validated app config (:class:`~deployments.config.AppConfig`)."""
        return cls(
            model_name=cfg.model_name,
            model_ids=(cfg.model_name, str(cfg.ralm.generator.model)),
            retrievers=tuple(cfg.retrievers),
            default_method=cfg.default_method,
            spec_defaults=cfg.ralm.spec,
            request_defaults=cfg.ralm.request,
            knn_defaults=cfg.knnlm.config,
            max_prompt_chars=cfg.ingress.max_prompt_chars,
            max_body_bytes=cfg.ingress.max_body_bytes,
            admin=cfg.ingress.admin,
            api_key=api_key,
            request_timeout_s=cfg.ingress.request_timeout_s,
        )


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

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = 1_048_576):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

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
        # read the body (at most limit bytes), then hand it on in one message
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([msg], receive), send)
            body = msg.get("body", b"")
            total += len(body)
            if total > limit:
                return await self._reply(send, 413, *too_big)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([first], receive), send)


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


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    e = cast(RequestValidationError, exc)
    msg, param = describe(list(e.errors()))
    return JSONResponse(error_body(msg, param=param), status_code=400)


def _check_greedy(body: CompletionRequest) -> None:
    def bad(param: str, why: str):
        raise ApiError(400, f"{param}: {why}", param=param)

    if body.temperature not in (None, 0, 0.0):
        bad(
            "temperature",
            "only greedy decoding is supported (temperature 0): ralmspec returns exactly the tokens of greedy RaLMSeq",
        )
    if body.top_p not in (None, 1, 1.0):
        bad("top_p", "only greedy decoding is supported (top_p 1)")
    if body.n not in (None, 1):
        bad("n", "only n=1 is supported (greedy decoding has one answer)")
    if body.best_of not in (None, 1):
        bad("best_of", "only best_of=1 is supported")
    if body.logprobs not in (None, 0):
        bad("logprobs", "logprobs are not supported")
    if body.stop not in (None, [], ""):
        bad("stop", "stop sequences are not supported")
    if body.suffix not in (None, ""):
        bad("suffix", "suffix is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            bad(name, "penalties are not supported (greedy decoding)")
    if body.logit_bias:
        bad("logit_bias", "logit_bias is not supported")


def _ralm_block(job: dict, res: dict) -> dict:
    """The ``ralm`` part of an OpenAI-style response: method, tokens, exactness and statistics."""
    return {
        "retriever": job["retriever"],
        "method": job["method"],
        "tokens": res["tokens"],
        "exact": res.get("exact", True),
        "stats": res["stats"],
    }


# ------------------------------------------------------------------ endpoints
class Endpoints:
    """The route handlers over one backend (and the ingress's request counters)."""

    def __init__(self, backend: RalmBackend, settings: IngressSettings):
        self.backend = backend
        self.settings = settings
        self.started = time.time()
        self.requests = 0
        self.errors = 0
        self.overloaded = 0  # refused with 503 (bounded queues full)
        self.timeouts = 0  # cancelled at their deadline (504)

    # ---------------------------------------------------------------- validation
    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        if model not in self.settings.model_ids:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _validate_prompt(self, prompt: str, param: str) -> int:
        limit = self.settings.max_prompt_chars
        if len(prompt) > limit:
            raise ApiError(
                400,
                f"{param} is {len(prompt)} characters long; the limit is {limit} characters "
                f"(and {self.backend.max_prompt_tokens} tokens)",
                param=param,
            )
        try:
            return len(self.backend.encode_question(prompt))
        except RalmInputError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def _job(
        self, question: str, opts: RalmOptions, max_new: int | None, max_param: str, rid: str | None = None
    ) -> dict:
        s = self.settings
        return build_job(
            opts,
            question,
            max_new,
            max_param,
            rid,
            kinds=list(s.retrievers),
            default_method=s.default_method,
            spec_defaults=s.spec_defaults,
            request_defaults=s.request_defaults,
            max_new_limit=self.backend.max_new_tokens,
            features=self.backend.features,
            knn_defaults=s.knn_defaults,
        )

    # ---------------------------------------------------------------- running
    @property
    def _deadline(self) -> float | None:
        return self.settings.request_timeout_s or None

    def _timeout_error(self) -> ApiError:
        return ApiError(
            504,
            f"the request did not finish within its deadline of {self.settings.request_timeout_s:g} s and was "
            "cancelled (ingress.request_timeout_s)",
            type_="timeout_error",
            code="timeout",
        )

    @staticmethod
    def _overloaded_error(e: Overloaded) -> ApiError:
        retry = max(1, math.ceil(e.retry_after_s))
        return ApiError(
            503, message_of(e), type_="overloaded_error", code="overloaded", headers={"Retry-After": str(retry)}
        )

    async def _run(self, job: dict) -> dict:
        self.requests += 1
        try:
            # past the deadline wait_for cancels the backend call: the backend stops the request
            return await asyncio.wait_for(self.backend.run(job), self._deadline)
        except (RalmInputError, ConfigError) as e:
            self.errors += 1
            raise ApiError(400, message_of(e)) from None
        except Overloaded as e:
            self.overloaded += 1
            raise self._overloaded_error(e) from None
        except (asyncio.TimeoutError, RequestCancelled):
            self.timeouts += 1
            raise self._timeout_error() from None
        except ApiError:
            raise
        except Exception as e:
            self.errors += 1
            log.exception("request failed")
            raise ApiError(500, f"internal error: {message_of(e)}", type_="server_error") from None

    def _chunk(self, cid: str, created: int, text: str, finish: str | None, **extra) -> str:
        obj = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.settings.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            **extra,
        }
        return f"data: {json.dumps(obj)}\n\n"

    async def _sse(
        self, job: dict, cid: str, created: int, echo: str, n_prompt: int, include_usage: bool
    ) -> AsyncIterator[str]:
        self.requests += 1
        stream = self.backend.stream(job)
        deadline = None if self._deadline is None else time.monotonic() + self._deadline
        try:
            if echo:
                yield self._chunk(cid, created, echo, None)
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(anext(stream), left)
                except StopAsyncIteration:
                    break
                if chunk.get("done"):
                    res = chunk["result"]
                    if chunk["delta"]:
                        yield self._chunk(cid, created, chunk["delta"], None)
                    n_out = len(res["tokens"])
                    extra = {"ralm": _ralm_block(job, res)}
                    if include_usage:
                        extra["usage"] = {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": n_out,
                            "total_tokens": n_prompt + n_out,
                        }
                    yield self._chunk(cid, created, "", res["finish_reason"], **extra)
                elif chunk["delta"]:
                    yield self._chunk(cid, created, chunk["delta"], None)
            yield "data: [DONE]\n\n"
        except (asyncio.TimeoutError, RequestCancelled):
            self.timeouts += 1
            t = self._timeout_error()
            yield f"data: {json.dumps(error_body(t.message, t.type, code=t.code))}\n\n"
        except Overloaded as e:
            self.overloaded += 1
            o = self._overloaded_error(e)
            body = error_body(o.message, o.type, code=o.code)
            body["error"]["retry_after"] = (o.headers or {}).get("Retry-After")
            yield f"data: {json.dumps(body)}\n\n"
        except Exception as e:
            self.errors += 1
            status = 400 if isinstance(e, (RalmInputError, ConfigError)) else 500
            msg = message_of(e)
            yield f"data: {json.dumps(error_body(msg, 'invalid_request_error' if status == 400 else 'server_error'))}\n\n"
        finally:
            await stream.aclose()  # the client went away: the backend cancels the request

    # ---------------------------------------------------------------- routes
    async def healthz(self):
        try:
            extra = await self.backend.health()
        except BackendUnavailable as e:
            return JSONResponse({"status": "unhealthy", "reason": e.reason}, status_code=503)
        return {
            "status": "ok",
            "model": self.settings.model_name,
            "retrievers": list(self.settings.retrievers),
            **extra,
            "uptime_s": time.time() - self.started,
        }

    async def models(self):
        s = self.settings
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": int(self.started),
                    "owned_by": "ralmspec",
                    "retrievers": list(s.retrievers),
                    "features": self.backend.features,
                }
            ],
        }

    async def stats(self):
        parts = await self.backend.stats()
        return {
            "requests": self.requests,
            "errors": self.errors,
            "overloaded": self.overloaded,
            "timeouts": self.timeouts,
            **parts,
            "features": self.backend.features,
        }

    async def admin_verifier(self, request: Request):
        if not self.settings.admin:
            raise ApiError(403, "the admin API is disabled (ingress.admin: true enables it)", code="forbidden")
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "request body is not valid JSON") from None
        upd = verifier_policy_update(body)
        return await self.backend.configure_verifiers(upd.model_dump(exclude={"reset_stats"}), upd.reset_stats)

    async def generate(self, body: GenerateRequest, x_request_id: str | None = Header(None)):
        n_prompt = self._validate_prompt(body.question, "question")
        job = self._job(body.question, body, body.max_new_tokens, "max_new_tokens", x_request_id)
        res = await self._run(job)
        res["prompt_tokens"] = n_prompt
        return {
            "model": self.settings.model_name,
            "retriever": job["retriever"],
            "method": job["method"],
            "request_id": job["request_id"],
            **res,
        }

    async def completions(self, body: CompletionRequest, x_request_id: str | None = Header(None)):
        self._check_model(body.model)
        _check_greedy(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(
                    400, f"prompt: exactly one prompt per request is supported, got {len(prompt)}", param="prompt"
                )
            prompt = prompt[0]
        n_prompt = self._validate_prompt(prompt, "prompt")
        job = self._job(prompt, body, body.max_tokens, "max_tokens", x_request_id)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                self._sse(job, cid, created, prompt if body.echo else "", n_prompt, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        res = await self._run(job)
        text = (prompt if body.echo else "") + res["text"]
        n_out = len(res["tokens"])
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.settings.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": res["finish_reason"]}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
            "ralm": _ralm_block(job, res),
        }


def build_http_app(backend: RalmBackend, settings: IngressSettings) -> FastAPI:
    """The FastAPI app of the ralmspec HTTP API over ``backend`` (no Ray needed)."""
    app = FastAPI(
        title="ralmspec",
        version="0.1.0",
        description="Iterative retrieval-augmented LM serving with exact speculative retrieval.",
    )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    ep = Endpoints(backend, settings)
    app.state.endpoints = ep
    app.get("/healthz")(ep.healthz)
    app.get("/v1/models")(ep.models)
    app.get("/v1/ralm/stats")(ep.stats)
    app.post("/v1/ralm/admin/verifier")(ep.admin_verifier)
    app.post("/v1/ralm/generate")(ep.generate)
    app.post("/v1/completions")(ep.completions)
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
