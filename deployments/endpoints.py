"""The route handlers of the HTTP API (:class:`Endpoints`) and the settings they read
(:class:`IngressSettings`).

:mod:`deployments.ingress` builds the FastAPI app over them (auth, body limits, error
mapping); :mod:`deployments.openai_routes` adds chat and embeddings on top. Nothing here
imports Ray: the work is done by a :class:`~deployments.backend.RalmBackend`.
"""

# no "from __future__ import annotations": FastAPI must see the body models as classes
import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Header, Request
from fastapi.responses import JSONResponse

from deployments.api import (
    ApiError,
    CompletionRequest,
    GenerateRequest,
    RalmOptions,
    build_job,
    check_greedy,
    error_body,
    message_of,
    ralm_block,
    verifier_policy_update,
)
from deployments.backend import BackendUnavailable, RalmBackend
from deployments.sse_response import ClosingStreamingResponse
from ralm import constants as C
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.errors import ConfigError, Overloaded, RalmInputError, RequestCancelled
from ralm.job import RalmJob
from ralm.results import RalmResult
from ralm.retrievers import entry

if TYPE_CHECKING:  # the config module pulls in the generator's (torch); the HTTP layer needs none of it
    from deployments.config import AppConfig

log = logging.getLogger(__name__)

# one server-sent event of a stream: (text delta, finish reason or None, extra fields) -> "data: ...\n\n"
ChunkFn = Callable[..., str]


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
    body_timeout_s: float = 30.0  # the whole body within this long, else 408
    admin: bool = False
    api_key: str | None = None
    request_timeout_s: float = 600.0  # 0: no deadline
    embedding_model: str | None = None  # the dense encoder served at /v1/embeddings (None: no dense retriever)
    embedding_ids: tuple[str, ...] = ()  # ids a /v1/embeddings request's ``model`` may name

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
            body_timeout_s=cfg.ingress.body_timeout_s,
            admin=cfg.ingress.admin,
            api_key=api_key,
            request_timeout_s=cfg.ingress.request_timeout_s,
            **_embedding_names(cfg),
        )


def _embedding_names(cfg: "AppConfig") -> dict:
    """``embedding_model`` (the encoder's short name) and the ids that name it, when a dense
    retriever is served: ``local:all-MiniLM-L6-v2`` answers to itself and ``all-MiniLM-L6-v2``."""
    if not any(entry(k).family.encodes for k in cfg.retrievers):
        return {}
    name = str(cfg.ralm.retriever.encoder)
    short = name.split(":", 1)[1] if name.startswith("local:") else name
    return {"embedding_model": short, "embedding_ids": tuple(dict.fromkeys((short, name)))}


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
    ) -> RalmJob:
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

    def _api_error(self, e: Exception) -> ApiError:
        """The HTTP error of a request that failed before its answer started (and count it)."""
        if isinstance(e, ApiError):
            return e
        if isinstance(e, (RalmInputError, ConfigError)):
            self.errors += 1
            return ApiError(400, message_of(e))
        if isinstance(e, Overloaded):
            self.overloaded += 1
            return self._overloaded_error(e)
        if isinstance(e, (asyncio.TimeoutError, RequestCancelled)):
            self.timeouts += 1
            return self._timeout_error()
        self.errors += 1
        log.error("request failed", exc_info=e)
        return ApiError(500, f"internal error: {message_of(e)}", type_="server_error")

    async def _run(self, job: RalmJob) -> RalmResult:
        self.requests += 1
        try:
            # past the deadline wait_for cancels the backend call: the backend stops the request
            return await asyncio.wait_for(self.backend.run(job), self._deadline)
        except Exception as e:
            raise self._api_error(e) from None

    async def _stream_response(
        self, job: RalmJob, chunk: ChunkFn, first: str | None, n_prompt: int, include_usage: bool
    ) -> ClosingStreamingResponse:
        """The SSE response of a streamed job. The backend's stream is opened and its first
        chunk awaited before the response starts, so a request shed or refused when it is
        admitted gets the status and headers a non-streamed one gets (503 with
        ``Retry-After``, 400, 504); errors after that are ``error`` events."""
        self.requests += 1
        stream = self.backend.stream(job)
        deadline = None if self._deadline is None else time.monotonic() + self._deadline
        try:
            head: dict | None = await asyncio.wait_for(anext(stream), self._deadline)
        except StopAsyncIteration:
            head = None
        except Exception as e:
            with contextlib.suppress(RuntimeError):
                await stream.aclose()
            raise self._api_error(e) from None
        return ClosingStreamingResponse(
            self._sse(job, stream, head, deadline, chunk, first, n_prompt, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

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
        self,
        job: RalmJob,
        stream: AsyncGenerator[dict, None],
        head: dict | None,
        deadline: float | None,
        chunk: ChunkFn,
        first: str | None,
        n_prompt: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed job whose first chunk ``head`` was read already
        (None: the stream was empty): ``first`` (when given), then ``chunk(delta, None)`` per
        verified piece of text, then ``chunk("", finish_reason, ralm=..., usage=...)`` and
        ``[DONE]``; errors become an ``error`` event. ``deadline``: ``time.monotonic()`` at
        which the request is cancelled (None: never)."""
        try:
            if first is not None:
                yield first
            while True:
                if head is not None:
                    piece, head = head, None
                else:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        piece = await asyncio.wait_for(anext(stream), left)
                    except StopAsyncIteration:
                        break
                if piece.get("done"):
                    res: RalmResult = piece["result"]
                    if piece["delta"]:
                        yield chunk(piece["delta"], None)
                    n_out = len(res.tokens)
                    extra = {"ralm": ralm_block(job, res)}
                    if include_usage:
                        extra["usage"] = {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": n_out,
                            "total_tokens": n_prompt + n_out,
                        }
                    yield chunk("", res.finish_reason, **extra)
                elif piece["delta"]:
                    yield chunk(piece["delta"], None)
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
        finally:  # closing the backend's stream cancels the request if it is still running
            with contextlib.suppress(RuntimeError):  # "already running": the cancelled read runs it
                await stream.aclose()

    # ---------------------------------------------------------------- routes
    async def healthz(self):
        try:
            extra = await self.backend.health()
        except BackendUnavailable as e:
            return JSONResponse(
                {"status": "unhealthy", "reason": e.reason},
                status_code=503,
                headers={"Retry-After": str(math.ceil(C.SHED_RETRY_AFTER_S))},
            )
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
            ]
            + (
                [{"id": s.embedding_model, "object": "model", "created": int(self.started), "owned_by": "ralmspec"}]
                if s.embedding_model
                else []
            ),
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
        return {
            "model": self.settings.model_name,
            "retriever": job.source,
            "method": job.method,
            "request_id": job.request_id,
            **res.as_dict(),
            "prompt_tokens": n_prompt,
        }

    async def completions(self, body: CompletionRequest, x_request_id: str | None = Header(None)):
        self._check_model(body.model)
        check_greedy(body)
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

            def chunk(text: str, finish: str | None, **extra) -> str:
                return self._chunk(cid, created, text, finish, **extra)

            first = chunk(prompt, None) if body.echo and prompt else None
            return await self._stream_response(job, chunk, first, n_prompt, include_usage)
        res = await self._run(job)
        text = (prompt if body.echo else "") + res.text
        n_out = len(res.tokens)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.settings.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": res.finish_reason}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
            "ralm": ralm_block(job, res),
        }


__all__ = ["ChunkFn", "Endpoints", "IngressSettings"]
