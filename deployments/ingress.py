"""HTTP front end (FastAPI through Ray Serve).

Endpoints:

- ``POST /v1/completions`` - OpenAI-compatible completions (``prompt``, ``max_tokens``,
  ``stream`` with server-sent events, ``echo``). Retrieval options are extra fields:
  ``retriever`` (edr|adr|sr), ``method`` (seq|spec|knnlm-seq|knnlm-spec), ``spec`` (a
  configuration name such as ``"PSA"``/``"base"``, or an object of
  :class:`~ralm.config.SpecConfig` fields), ``stride``, ``prefetch_size``, and the
  generation-side modes of :class:`~ralm.config.RequestConfig` (``num_docs``, ``drafting``
  and its ``ngram_*``/``dense_*`` knobs, ``workload`` with ``flare_threshold`` /
  ``iter_retgen_iterations``, ``idgr``, ``allow_inexact_shifted_reuse``, ...) and ``knn``
  (KNN-LM options); see :class:`deployments.api.RalmOptions`. The response carries the
  request's statistics and ``exact`` under ``ralm``.
- ``GET /v1/models`` - the served model (and the optional modes it serves, ``features``).
- ``POST /v1/ralm/generate`` - native: ``question`` + the same options, returns text,
  tokens, finish reason, ``exact`` (false when an inexact option - IDGR, shifted doc-KV
  reuse - was on) and :meth:`~ralm.results.RequestStats.as_dict`.
- ``GET /v1/ralm/stats`` - coordinator pool, verifiers (batching) and generator.
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

Each request leases a coordinator from the pool (:mod:`actors.pool`), which runs the
core loop; the ingress only validates, routes and formats.
"""
# no "from __future__ import annotations": FastAPI must see the body models as classes
import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from typing import Any, Optional

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from deployments.api import (ApiError, CompletionRequest, GenerateRequest, RalmOptions, build_job, describe,
                             error_body, message_of, request_id, verifier_policy_update)
from deployments.config import AppConfig
from ralm.config import GeneratorConfig
from ralm.errors import ConfigError, RalmInputError

log = logging.getLogger(__name__)

app = FastAPI(title="ralmspec", version="0.1.0",
              description="Iterative retrieval-augmented LM serving with exact speculative retrieval.")


# ------------------------------------------------------------------ errors (deployments.api)
_error_body, _message = error_body, message_of


@app.exception_handler(ApiError)
async def _api_error(_: Request, e: ApiError):
    return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status)


# ------------------------------------------------------------------ API key and body size
API_KEY_ENV = "RALMSPEC_API_KEY"
API_KEY_FILE_ENV = "RALMSPEC_API_KEY_FILE"
OPEN_PATHS = frozenset({"/healthz"})


def read_api_key(environ=None) -> Optional[str]:
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
            raise ValueError(f"cannot read the API key file named by {API_KEY_FILE_ENV} ({path}): {e.strerror}") from None
        if not key:
            raise ValueError(f"the API key file {path} is empty")
    return key.strip() if key else None


class _Guard:
    """Settings of :class:`GuardMiddleware`, set by the ingress replica at start."""

    api_key: Optional[str] = None
    max_body_bytes: int = 1_048_576


GUARD = _Guard()


class GuardMiddleware:
    """ASGI middleware: bearer-token check (when a key is set) and a request body size limit
    (checked on Content-Length and while reading, before the JSON is parsed)."""

    def __init__(self, app):
        self.app = app

    @staticmethod
    async def _reply(send, status: int, message: str, code: str, headers: list | None = None) -> None:
        body = json.dumps(_error_body(message, "invalid_request_error", None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())] + (headers or [])})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        key = GUARD.api_key
        if key and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if not auth:
                return await self._reply(send, 401, "missing API key: send the header 'Authorization: Bearer <key>'",
                                         "missing_api_key", [(b"www-authenticate", b"Bearer")])
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return await self._reply(send, 401, "invalid API key", "invalid_api_key",
                                         [(b"www-authenticate", b'Bearer error="invalid_token"')])
        limit = GUARD.max_body_bytes
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


app.add_middleware(GuardMiddleware)

_request_id, _describe = request_id, describe


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    msg, param = _describe(list(e.errors()))
    return JSONResponse(_error_body(msg, param=param), status_code=400)


# ------------------------------------------------------------------ the deployment
def _prepare_shards_task(rcfg: dict, corpus_path: str, index_dir: str, n_shards: int, build: bool,
                         vectors_from: Optional[str] = None):
    """One-off task: build missing indexes and shard slices; returns the shard specs."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from actors.shard import prepare_shards
    from ralm.config import RetrieverConfig
    from ralm.corpus import Corpus
    from ralm.retrieval.index_build import MANIFEST

    cfg = RetrieverConfig.model_validate(rcfg)
    if not build and not (os.path.isfile(os.path.join(index_dir, MANIFEST))):
        from ralm.retrieval.errors import IndexNotFoundError
        raise IndexNotFoundError(f"no {cfg.kind} index at {index_dir} and build_indexes is off; build it with "
                                 f"`ralmspec index --retriever {cfg.kind}`")
    missing = not os.path.isfile(os.path.join(index_dir, MANIFEST))
    if missing and cfg.kind in ("edr", "adr"):
        import torch
        torch.set_num_threads(os.cpu_count() or 1)    # Ray gives tasks OMP_NUM_THREADS=1; encode on every core
    if missing:
        print(f"ralmspec: no {cfg.kind} index at {index_dir}: building it (first start; progress below)",
              flush=True)
    specs = prepare_shards(cfg, Corpus.load(corpus_path), index_dir, n_shards, progress=missing,
                           vectors_from=vectors_from)
    import hashlib
    with open(os.path.join(index_dir, MANIFEST), "rb") as fh:     # identifies the index build
        version = hashlib.sha256(fh.read()).hexdigest()
    return specs, version


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    async def __init__(self, generator: Any, config: dict):
        import ray

        from actors.coordinator import RemoteGenerator, coordinator_actor_class
        from actors.pool import CoordinatorPool
        from actors.shard import start_shards
        from actors.verifier import verifier_actor_class

        self.cfg = cfg = AppConfig.model_validate(config)
        import deployments.ingress as this     # the module's GUARD (this class may be pickled by value)

        guard = this.GUARD
        guard.api_key = read_api_key()
        guard.max_body_bytes = cfg.ingress.max_body_bytes
        if guard.api_key:
            log.info("ralmspec ingress: API key required (from %s)",
                     API_KEY_FILE_ENV if os.environ.get(API_KEY_FILE_ENV) else API_KEY_ENV)
        self.generator = generator
        self.model_name = cfg.model_name
        self.kinds = list(cfg.retrievers)
        info = await generator.info.remote()
        tok = await generator.tokenizer.remote()
        self.gen_info = info
        self.features = dict(info.get("features") or {})     # optional modes: dense drafting, KNN-LM
        self.codec = RemoteGenerator(None, tok, GeneratorConfig(max_prompt_tokens=info["max_prompt_tokens"],
                                                                max_new_tokens=info["max_new_tokens"]),
                                     info["eos_token_id"])
        prep = ray.remote(num_cpus=cfg.sharding.build_num_cpus, max_calls=1)(_prepare_shards_task)
        self.shards: dict[str, list] = {}
        self.shard_names: dict[str, list[str]] = {}
        self.verifiers: dict[str, Any] = {}
        self.index_versions: dict[str, str] = {}
        vcls = verifier_actor_class(cfg.verifier.num_cpus)
        build_order = sorted(self.kinds, key=lambda k: {"edr": 0, "sr": 1, "adr": 2}[k])   # adr reuses edr's vectors
        for kind in build_order:
            rcfg = cfg.ralm.retriever.model_copy(update={"kind": kind})
            if kind != "edr":
                rcfg = rcfg.model_copy(update={"pad_to": 0})
            index_dir = cfg.ralm.index_dir(kind)
            specs, self.index_versions[kind] = await prep.remote(rcfg.model_dump(mode="json"), str(cfg.ralm.corpus), str(index_dir),
                                      cfg.sharding.n_shards, cfg.build_indexes, str(cfg.ralm.index_dir("edr")))
            sh = cfg.sharding
            prefix = f"shard-{kind}-{uuid.uuid4().hex[:8]}"
            actors = await asyncio.to_thread(start_shards, specs, sh.num_cpus, sh.max_restarts,
                                             sh.max_task_retries, True, prefix)
            self.shards[kind] = actors
            self.shard_names[kind] = [f"{prefix}-{s.index}" for s in specs]
            v = cfg.verifier
            self.verifiers[kind] = vcls.remote(kind, actors, [(s.lo, s.hi) for s in specs],
                                               rcfg.model_dump(mode="json"), v.window_ms, v.max_batch,
                                               v.batching, v.max_inflight, v.flush_when_all_waiting)
        await asyncio.gather(*(v.ping.remote() for v in self.verifiers.values()))

        coord_cls = coordinator_actor_class(cfg.pool.num_cpus)
        req_defaults = cfg.ralm.request.model_dump(mode="json")
        spec_defaults = cfg.ralm.spec.model_dump(mode="json")

        from cache.state import STATE_URL_ENV, StateStoreConfig, redact_url

        store_cfg = cfg.state.store
        if store_cfg is None and os.environ.get(STATE_URL_ENV):
            store_cfg = StateStoreConfig.from_env()
        state = {"store": store_cfg.model_dump(mode="json") if store_cfg is not None else None,
                 "checkpoints": cfg.state.checkpoints,
                 "kb_cache": {k: self.index_versions[k] for k in cfg.state.kb_cache} if store_cfg else {}}
        self.state_info = {"store": redact_url(store_cfg.url) if store_cfg else None,
                           "checkpoints": bool(store_cfg and cfg.state.checkpoints and store_cfg.scheme != "memory"),
                           "kb_cache": sorted(state["kb_cache"])}

        def factory():
            return coord_cls.options(name=f"coordinator-{uuid.uuid4().hex[:12]}", namespace="ralmspec").remote(
                generator, self.verifiers, req_defaults, spec_defaults, state=state)

        async def ready(h):
            await h.ready.remote()

        self.pool = CoordinatorPool(factory, ready, cfg.pool.size, cfg.pool.max_size)
        await self.pool.start()
        self.started = time.time()
        self.requests = 0
        self.errors = 0
        log.info("ralmspec ingress ready: model %s, retrievers %s, %d shards each, pool %d",
                 self.model_name, self.kinds, cfg.sharding.n_shards, cfg.pool.size)

    # ---------------------------------------------------------------- validation
    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        if model not in (self.model_name, str(self.cfg.ralm.generator.model)):
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _validate_prompt(self, prompt: str, param: str) -> int:
        limit = self.cfg.ingress.max_prompt_chars
        if len(prompt) > limit:
            raise ApiError(400, f"{param} is {len(prompt)} characters long; the limit is {limit} characters "
                                f"(and {self.codec.cfg.max_prompt_tokens} tokens)", param=param)
        try:
            return len(self.codec.encode_question(prompt))
        except RalmInputError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def _job(self, question: str, opts: RalmOptions, max_new: Optional[int], max_param: str,
             rid: Optional[str] = None) -> dict:
        return build_job(opts, question, max_new, max_param, rid, kinds=self.kinds,
                         default_method=self.cfg.default_method, spec_defaults=self.cfg.ralm.spec,
                         request_defaults=self.cfg.ralm.request, max_new_limit=self.codec.cfg.max_new_tokens,
                         features=self.features, knn_defaults=self.cfg.knnlm.config)

    @staticmethod
    def _check_greedy(body: CompletionRequest) -> None:
        def bad(param: str, why: str):
            raise ApiError(400, f"{param}: {why}", param=param)

        if body.temperature not in (None, 0, 0.0):
            bad("temperature", "only greedy decoding is supported (temperature 0): ralmspec returns exactly "
                               "the tokens of greedy RaLMSeq")
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

    # ---------------------------------------------------------------- running
    async def _run(self, job: dict) -> dict:
        self.requests += 1
        try:
            return await self.pool.run(lambda c: c.run.remote(job))
        except (RalmInputError, ConfigError) as e:
            self.errors += 1
            raise ApiError(400, _message(e)) from None
        except ApiError:
            raise
        except Exception as e:
            self.errors += 1
            log.exception("request failed")
            raise ApiError(500, f"internal error: {_message(e)}", type_="server_error") from None

    # ---------------------------------------------------------------- endpoints
    @app.get("/healthz")
    async def healthz(self):
        try:
            await asyncio.wait_for(asyncio.gather(*(v.ping.remote() for v in self.verifiers.values())), 10)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "reason": f"verifier: {type(e).__name__}"}, status_code=503)
        return {"status": "ok", "model": self.model_name, "retrievers": self.kinds,
                "pool": self.pool.stats.as_dict(), "uptime_s": time.time() - self.started}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": int(self.started), "owned_by": "ralmspec",
                                            "retrievers": self.kinds, "features": self.features}]}

    @app.get("/v1/ralm/stats")
    async def stats(self):
        vstats = await asyncio.gather(*(v.stats.remote() for v in self.verifiers.values()))
        ginfo = await self.generator.info.remote()
        return {"requests": self.requests, "errors": self.errors, "pool": self.pool.stats.as_dict(),
                "verifiers": dict(zip(self.verifiers, vstats)), "generator": ginfo,
                "shards": {k: {"namespace": "ralmspec", "names": v} for k, v in self.shard_names.items()},
                "state": self.state_info, "features": self.features}

    @app.post("/v1/ralm/admin/verifier")
    async def admin_verifier(self, request: Request):
        if not self.cfg.ingress.admin:
            raise ApiError(403, "the admin API is disabled (ingress.admin: true enables it)", code="forbidden")
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "request body is not valid JSON") from None
        upd = verifier_policy_update(body)
        policy = upd.model_dump(exclude={"reset_stats"})
        out = {}
        for kind, v in self.verifiers.items():
            out[kind] = await v.configure.remote(**policy)
            if upd.reset_stats:
                await v.stats.remote(True)
        return out

    @app.post("/v1/ralm/generate")
    async def generate(self, body: GenerateRequest, x_request_id: Optional[str] = Header(None)):
        n_prompt = self._validate_prompt(body.question, "question")
        job = self._job(body.question, body, body.max_new_tokens, "max_new_tokens", x_request_id)
        res = await self._run(job)
        res["prompt_tokens"] = n_prompt
        return {"model": self.model_name, "retriever": job["retriever"], "method": job["method"],
                "request_id": job["request_id"], **res}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, x_request_id: Optional[str] = Header(None)):
        self._check_model(body.model)
        self._check_greedy(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: exactly one prompt per request is supported, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        n_prompt = self._validate_prompt(prompt, "prompt")
        job = self._job(prompt, body, body.max_tokens, "max_tokens", x_request_id)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(job, cid, created, prompt if body.echo else "", n_prompt,
                                               include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        res = await self._run(job)
        text = (prompt if body.echo else "") + res["text"]
        n_out = len(res["tokens"])
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": res["finish_reason"]}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
                "ralm": self._ralm_block(job, res)}

    @staticmethod
    def _ralm_block(job: dict, res: dict) -> dict:
        """The ``ralm`` part of an OpenAI-style response: method, tokens, exactness and statistics."""
        return {"retriever": job["retriever"], "method": job["method"], "tokens": res["tokens"],
                "exact": res.get("exact", True), "stats": res["stats"]}

    def _chunk(self, cid: str, created: int, text: str, finish: str | None, **extra) -> str:
        obj = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
               "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(obj)}\n\n"

    async def _sse(self, job: dict, cid: str, created: int, echo: str, n_prompt: int, include_usage: bool):
        from actors.pool import _is_actor_death

        self.requests += 1
        coord = await self.pool.acquire()
        stream = coord.run_stream.options(num_returns="streaming").remote(job)
        done = False
        try:
            if echo:
                yield self._chunk(cid, created, echo, None)
            async for ref in stream:
                chunk = await ref
                if chunk.get("done"):
                    res = chunk["result"]
                    if chunk["delta"]:
                        yield self._chunk(cid, created, chunk["delta"], None)
                    n_out = len(res["tokens"])
                    extra = {"ralm": self._ralm_block(job, res)}
                    if include_usage:
                        extra["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                          "total_tokens": n_prompt + n_out}
                    yield self._chunk(cid, created, "", res["finish_reason"], **extra)
                elif chunk["delta"]:
                    yield self._chunk(cid, created, chunk["delta"], None)
            done = True
            self.pool.release(coord)
            yield "data: [DONE]\n\n"
        except Exception as e:
            self.errors += 1
            done = True
            if _is_actor_death(e):
                asyncio.ensure_future(self.pool.replace(coord))
            else:
                self.pool.release(coord)
            status = 400 if isinstance(e, (RalmInputError, ConfigError)) else 500
            msg = _message(e)
            yield f"data: {json.dumps(_error_body(msg, 'invalid_request_error' if status == 400 else 'server_error'))}\n\n"
        finally:
            if not done:          # client went away: keep the lease until the coordinator is free
                asyncio.ensure_future(self._drain(stream, coord))

    async def _drain(self, stream, coord) -> None:
        try:
            async for ref in stream:
                await ref
        except Exception:
            pass
        self.pool.release(coord)
