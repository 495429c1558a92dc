"""The HTTP API's request bodies, its error format, and how a body becomes a coordinator job.

Kept apart from :mod:`deployments.ingress` (the Serve deployment) so the validation can be
tested without Ray. Every per-request option is checked by the very pydantic models the
core uses (:class:`~ralm.config.RequestConfig`, :class:`~ralm.config.SpecConfig`,
:class:`~ralm.config.KnnLMConfig`), so a bad value gets a 400 naming the field, the
constraint and the value, before any work starts.
"""

# no "from __future__ import annotations": FastAPI must see the body models as classes
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.methods import KNN_METHODS, MethodName, describe_methods, method_info


# ------------------------------------------------------------------ errors
class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def message_of(e: BaseException) -> str:
    """A user-facing message: the original error of a Ray task error, without its traceback."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return message_of(cause)
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member tried into an error's location (``str``, ``SpecOptions``...)."""
    return part in ("str", "int", "float", "bool", "dict", "list", "SpecOptions") or "[" in part


def describe(errors: list) -> tuple:
    """(message, first parameter) of pydantic errors."""
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(str(x))]
        name = ".".join(loc)
        param = param or (loc[0] if loc else None)
        typ = err.get("type", "")
        if typ == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"request body is not valid JSON ({ctx})" if ctx else "request body is not valid JSON", None
        if typ == "extra_forbidden":
            parts.append(f"unknown field {name!r}")
        elif typ == "missing" and not name:
            parts.append("the request body is required: send a JSON object")
        elif typ == "missing":
            parts.append(f"field {name!r} is required")
        else:
            got = err.get("input")
            got_s = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
            parts.append(f"{name or 'body'}: {err.get('msg', 'invalid')} (got {got_s})")
    return "invalid request: " + "; ".join(parts), param


def _validated(model, data: dict, prefix: str = ""):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = [
            {**err, "loc": tuple(f"{prefix}{x}" if i == 0 and prefix else x for i, x in enumerate(err.get("loc", ())))}
            for err in e.errors()
        ]
        msg, param = describe(errs)
        raise ApiError(400, msg, param=param) from None


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(value: str | None) -> str:
    """The client's ``X-Request-ID`` (it names the request's checkpoint), or a fresh one."""
    if value is None or value == "":
        return uuid.uuid4().hex
    if not _REQUEST_ID.match(value):
        raise ApiError(400, "X-Request-ID must be 1-128 characters of letters, digits and ._:-", param="X-Request-ID")
    return value


# ------------------------------------------------------------------ request bodies
class SpecOptions(BaseModel):
    """RaLMSpec options (any subset of :class:`~ralm.config.SpecConfig` fields)."""

    model_config = ConfigDict(extra="forbid")
    prefetch: StrictBool | None = None
    prefetch_size: StrictInt | None = None
    adaptive_stride: StrictBool | None = None
    async_verify: StrictBool | None = None
    stride: StrictInt | None = None
    os3_window: StrictInt | None = None
    gamma_estimate: Literal["positional", "bayes", "capped"] | None = None
    gamma_quantile: float | None = None
    gamma_max: float | None = None
    max_stride: StrictInt | None = None
    shared_kb_direct_at: StrictInt | None = None


class KnnOptions(BaseModel):
    """KNN-LM options of a request (methods knnlm-seq/knnlm-spec; :class:`~ralm.config.KnnLMConfig`)."""

    model_config = ConfigDict(extra="forbid")
    k: StrictInt | None = Field(None, description="Neighbours retrieved per token (1..1024).")
    temperature: StrictFloat | None = Field(None, description="T of p_knn ~ exp(-dist/T).")
    lmbda: StrictFloat | None = Field(None, description="lambda: weight of p_knn in the interpolation (0..1).")
    spatial_next: StrictInt | None = Field(
        None, description="knnlm-spec: successors of each retrieved entry put into the cache."
    )
    cache_max_entries: StrictInt | None = Field(
        None, description="knnlm-spec: speculative cache capacity (0: automatic)."
    )


# RequestConfig fields a request may set, beyond max tokens (their constraints are RequestConfig's)
GENERATION_FIELDS = (
    "generation_stride",
    "query_window",
    "ignore_eos",
    "num_docs",
    "drafting",
    "ngram_n",
    "ngram_min_n",
    "ngram_m",
    "dense_num_drafts",
    "dense_draft_len",
    "dense_candidates",
    "workload",
    "flare_threshold",
    "iter_retgen_iterations",
    "idgr",
    "idgr_unrelated",
    "allow_inexact_shifted_reuse",
)


class RalmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    retriever: StrictStr | None = Field(None, description="edr, adr or sr (default: the server's first).")
    method: MethodName | None = Field(None, description=describe_methods() + " (KNN-LM: when the server enables it).")
    spec: StrictStr | SpecOptions | None = Field(
        None, description="'base', any of P/S/A (e.g. 'PSA'), or an object of SpecConfig fields."
    )
    stride: StrictInt | None = Field(None, description="Fixed speculation stride s.")
    prefetch_size: StrictInt | None = Field(None, description="p, documents prefetched per query (with P).")
    generation_stride: StrictInt | None = Field(None, description="k, tokens generated per retrieval.")
    query_window: StrictInt | None = Field(None, description="Query = last N tokens.")
    ignore_eos: StrictBool | None = Field(None, description="Never stop at EOS (fixed-length generation).")
    # ---- generation-side modes (RequestConfig; exact unless stated)
    num_docs: StrictInt | None = Field(
        None,
        description="Documents per prompt (1..8): the KB's top-n in rank order; their KV is reused through the doc-KV prefix tree.",
    )
    drafting: Literal["none", "ngram", "dense"] | None = Field(
        None,
        description="Draft tokens and verify them in one forward pass: 'ngram' (copy from documents/question) or 'dense' (DReSD datastore; needs a server that enables it).",
    )
    ngram_n: StrictInt | None = Field(None, description="n-gram drafting: match the last N tokens (1..64).")
    ngram_min_n: StrictInt | None = Field(
        None, description="n-gram drafting: back off to matches of this length (1..64)."
    )
    ngram_m: StrictInt | None = Field(None, description="n-gram drafting: tokens per draft (1..256).")
    dense_num_drafts: StrictInt | None = Field(
        None, description="dense drafting: drafts per batched verification (1..32)."
    )
    dense_draft_len: StrictInt | None = Field(None, description="dense drafting: tokens per draft (1..256).")
    dense_candidates: StrictInt | None = Field(
        None, description="dense drafting: datastore neighbours fetched (1..1024)."
    )
    workload: Literal["fixed", "flare", "iter_retgen"] | None = Field(
        None,
        description="Retrieval trigger: every k tokens ('fixed'), before a low-confidence token ('flare'), or per Iter-RetGen iteration ('iter_retgen').",
    )
    flare_threshold: StrictFloat | None = Field(
        None, description="FLARE: a token with greedy probability below this ends the step (0 < t < 1)."
    )
    iter_retgen_iterations: StrictInt | None = Field(None, description="Iter-RetGen: number of iterations (1..1024).")
    idgr: StrictBool | None = Field(
        None,
        description="IDGR instruction block listing related/unrelated doc ids. INEXACT: changes the output (the response says exact: false).",
    )
    idgr_unrelated: StrictInt | None = Field(
        None, description="IDGR: lower-ranked doc ids listed as unrelated (0..64)."
    )
    allow_inexact_shifted_reuse: StrictBool | None = Field(
        None,
        description="Reuse a document's stand-alone KV at another position (IDR2). INEXACT: changes the output (exact: false).",
    )
    knn: KnnOptions | None = Field(None, description="KNN-LM options (methods knnlm-seq / knnlm-spec only).")


class CompletionRequest(RalmOptions):
    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    best_of: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    stop: StrictStr | list[StrictStr] | None = None
    suffix: StrictStr | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: StrictStr | None = None
    seed: StrictInt | None = None


class ChatCompletionRequest(RalmOptions):
    """``POST /v1/chat/completions``: OpenAI's chat body plus the retrieval options."""

    model: StrictStr | None = None
    messages: list[Any] = Field(
        description="The conversation: [{role: system|developer|user|assistant, content: text or text parts}]."
    )
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = Field(None, description="Same as max_tokens (newer clients).")
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: StrictStr | None = None
    seed: StrictInt | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's embeddings body, served by the dense encoder."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


class GenerateRequest(RalmOptions):
    question: StrictStr
    max_new_tokens: StrictInt | None = None


# ------------------------------------------------------------------ OpenAI-body checks
def check_greedy(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for every sampling or output option a greedy, exact server cannot honour."""

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
    if getattr(body, "best_of", None) not in (None, 1):
        bad("best_of", "only best_of=1 is supported")
    if body.logprobs not in (None, 0):
        bad("logprobs", "logprobs are not supported")
    if body.stop not in (None, [], ""):
        bad("stop", "stop sequences are not supported")
    if getattr(body, "suffix", None) not in (None, ""):
        bad("suffix", "suffix is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            bad(name, "penalties are not supported (greedy decoding)")
    if body.logit_bias:
        bad("logit_bias", "logit_bias is not supported")


def ralm_block(job: dict, res: dict) -> dict:
    """The ``ralm`` part of an OpenAI-style response: method, tokens, exactness and statistics."""
    return {
        "retriever": job["retriever"],
        "method": job["method"],
        "tokens": res["tokens"],
        "exact": res.get("exact", True),
        "stats": res["stats"],
    }


class VerifierPolicyUpdate(BaseModel):
    """Body of ``POST /v1/ralm/admin/verifier``: the batching policy fields to change (the
    others keep their values; see :class:`deployments.config.VerifierOptions`)."""

    model_config = ConfigDict(extra="forbid")
    batching: StrictBool | None = None
    window_ms: float | None = None
    max_batch: StrictInt | None = Field(None, ge=1)
    max_inflight: StrictInt | None = Field(None, ge=1)
    flush_when_all_waiting: StrictBool | None = None
    wait_for_speculating: StrictBool | None = None
    reset_stats: StrictBool = False


def verifier_policy_update(body) -> VerifierPolicyUpdate:
    """The validated admin body; a 400 naming the field otherwise."""
    return _validated(VerifierPolicyUpdate, body)


# ------------------------------------------------------------------ body -> job
def _not_enabled(what: str, how: str, param: str) -> ApiError:
    return ApiError(400, f"{what} is not enabled on this server: {how}", param=param, code="mode_not_enabled")


def build_job(
    opts: RalmOptions,
    question: str,
    max_new: int | None,
    max_param: str,
    rid: str | None,
    *,
    kinds: list,
    default_method: str,
    spec_defaults: SpecConfig,
    request_defaults: RequestConfig,
    max_new_limit: int,
    features: dict,
    knn_defaults: KnnLMConfig | None = None,
) -> dict:
    """The coordinator job of a validated body: ``{question, retriever, method, spec, request,
    request_id}`` (plus ``knn`` for KNN-LM). ``features``: ``{"dense_drafting": bool, "knnlm": bool}``
    of the generator. Raises :class:`ApiError` (400) for any invalid or unavailable option."""
    method = opts.method or default_method
    info = method_info(method)
    knn_method = info.knn
    if knn_method and not features.get("knnlm"):
        raise _not_enabled(
            "knnlm",
            "start the server with knnlm.enabled: true in the app config "
            f"(serve_config.yaml args) to serve methods {' and '.join(KNN_METHODS)}",
            "method",
        )
    if knn_method and opts.retriever is not None:
        raise ApiError(
            400,
            f"retriever does not apply to method {method!r}: KNN-LM retrieves from its token datastore",
            param="retriever",
        )
    kind = opts.retriever or kinds[0]
    if not knn_method and kind not in kinds:
        raise ApiError(400, f"unknown retriever {kind!r}: this server serves {', '.join(kinds)}", param="retriever")
    if opts.knn is not None and not knn_method:
        raise ApiError(
            400, f"knn options apply only to methods {' and '.join(KNN_METHODS)} (method is {method!r})", param="knn"
        )

    spec_upd: dict = {}
    if isinstance(opts.spec, str):
        try:
            named = SpecConfig.named(opts.spec)
        except ValueError as e:
            raise ApiError(400, str(e), param="spec") from None
        spec_upd.update(prefetch=named.prefetch, adaptive_stride=named.adaptive_stride, async_verify=named.async_verify)
    elif opts.spec is not None:
        spec_upd.update(opts.spec.model_dump(exclude_none=True))
    if opts.stride is not None:
        spec_upd["stride"] = opts.stride
    if opts.prefetch_size is not None:
        spec_upd["prefetch_size"] = opts.prefetch_size

    req_upd: dict = {}
    if max_new is not None:
        if max_new < 1 or max_new > max_new_limit:
            got = str(max_new) if len(str(max_new)) <= 24 else f"a {len(str(max_new))}-digit number"
            raise ApiError(400, f"{max_param} must be between 1 and {max_new_limit}, got {got}", param=max_param)
        req_upd["max_new_tokens"] = max_new
    for name in GENERATION_FIELDS:
        v = getattr(opts, name)
        if v is not None:
            req_upd[name] = v
    if knn_method:
        doc_level = sorted(n for n in req_upd if n not in ("max_new_tokens", "ignore_eos"))
        if doc_level:
            raise ApiError(
                400,
                f"{', '.join(doc_level)} {'does' if len(doc_level) == 1 else 'do'} not apply to "
                f"method {method!r}: KNN-LM is a "
                "token-level loop (it takes max tokens, ignore_eos, spec and knn)",
                param=doc_level[0],
            )
        if spec_upd.get("async_verify") and not info.async_verify:
            raise ApiError(
                400,
                "asynchronous verification (A) is not supported for KNN-LM (as in the RaLMSpec "
                "paper); use a fixed stride or S",
                param="spec",
            )
        spec_upd.setdefault("async_verify", False)  # the server's default A does not apply to KNN-LM
        base_req = RequestConfig(max_new_tokens=request_defaults.max_new_tokens, ignore_eos=request_defaults.ignore_eos)
    else:
        base_req = request_defaults
    spec = _validated(SpecConfig, {**spec_defaults.model_dump(), **spec_upd})
    req = _validated(RequestConfig, {**base_req.model_dump(), **req_upd})
    if req.drafting == "dense" and not features.get("dense_drafting"):
        raise _not_enabled(
            "dense drafting",
            "no DReSD datastore is configured (app config dense_drafting.datastore); use drafting 'ngram' or 'none'",
            "drafting",
        )
    job = {
        "question": question,
        "retriever": "knn" if knn_method else kind,
        "method": method,
        "spec": spec.model_dump(),
        "request": req.model_dump(),
        "request_id": request_id(rid),
    }
    if knn_method:
        over = opts.knn.model_dump(exclude_none=True) if opts.knn is not None else {}
        base = (knn_defaults or KnnLMConfig()).model_dump()
        _validated(KnnLMConfig, {**base, **over}, "knn.")
        job["knn"] = over
    return job
