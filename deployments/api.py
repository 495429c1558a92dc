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
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

from ralm import constants as C
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.job import KNN_REQUEST_FIELDS, KnnRequestOptions, RalmJob
from ralm.methods import KNN_METHODS, MethodName, describe_methods, method_info
from ralm.results import RalmResult


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


def _prefixed_error(e: ValidationError, prefix: str = "") -> ApiError:
    """A 400 naming the fields of ``e``, each under ``prefix`` (``knn.k``)."""
    errs = [
        {**err, "loc": tuple(f"{prefix}{x}" if i == 0 and prefix else x for i, x in enumerate(err.get("loc", ())))}
        for err in e.errors()
    ]
    msg, param = describe(errs)
    return ApiError(400, msg, param=param)


def _validated(model, data: dict, prefix: str = ""):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _prefixed_error(e, prefix) from None


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(value: str | None) -> str:
    """The client's ``X-Request-ID`` (it names the request's checkpoint), or a fresh one."""
    if value is None or value == "":
        return uuid.uuid4().hex
    if not _REQUEST_ID.match(value):
        raise ApiError(400, "X-Request-ID must be 1-128 characters of letters, digits and ._:-", param="X-Request-ID")
    return value


# ------------------------------------------------------------------ request bodies
_STRICT = {bool: StrictBool, int: StrictInt, float: StrictFloat, str: StrictStr}  # JSON "4" is not 4, nor 1 true


def optional_fields(source: type[BaseModel], names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``create_model`` fields for a body that may set any of ``source``'s fields ``names``
    (default: all): each optional (None: the server's value), strict about its JSON type, and
    described as ``source`` describes it. Their constraints stay ``source``'s, checked when the
    job is built, so a body model never copies a field by hand."""
    out: dict[str, Any] = {}
    for name in names or tuple(source.model_fields):
        f = source.model_fields[name]
        typ: Any = _STRICT.get(f.annotation, f.annotation)  # type: ignore[arg-type]
        out[name] = (Optional[typ], Field(None, description=f.description))  # noqa: UP045 (typ is a runtime value)
    return out


# RequestConfig fields a request may set, beyond max tokens (their constraints are RequestConfig's)
GENERATION_FIELDS = tuple(n for n in RequestConfig.model_fields if n != "max_new_tokens")
_FORBID = ConfigDict(extra="forbid")

SpecOptions = create_model(
    "SpecOptions",
    __config__=_FORBID,
    __doc__="RaLMSpec options: any subset of :class:`~ralm.config.SpecConfig` fields.",
    **optional_fields(SpecConfig),
)
KnnOptions = create_model(
    "KnnOptions",
    __config__=_FORBID,
    __doc__="KNN-LM options of a request (methods knnlm-seq/knnlm-spec; :class:`~ralm.config.KnnLMConfig`).",
    **optional_fields(KnnLMConfig, KNN_REQUEST_FIELDS),
)
_GenerationOptions = create_model(
    "GenerationOptions", __config__=_FORBID, **optional_fields(RequestConfig, GENERATION_FIELDS)
)


class RalmOptions(_GenerationOptions):
    """The retrieval options every generation body takes (plus :class:`~ralm.config.RequestConfig`'s
    generation fields, derived from it)."""

    model_config = ConfigDict(extra="forbid")
    retriever: StrictStr | None = Field(None, description="edr, adr or sr (default: the server's first).")
    method: MethodName | None = Field(None, description=describe_methods() + " (KNN-LM: when the server enables it).")
    spec: StrictStr | SpecOptions | None = Field(
        None,
        description="A configuration name in SpecConfig.parse's grammar ('base', 'PSA', 'PSA@0.9', 's=4', "
        "'PSA;max_stride=4'), or an object of SpecConfig fields.",
    )
    stride: StrictInt | None = Field(None, description=SpecConfig.model_fields["stride"].description)
    prefetch_size: StrictInt | None = Field(None, description=SpecConfig.model_fields["prefetch_size"].description)
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


def ralm_block(job: RalmJob, res: RalmResult) -> dict:
    """The ``ralm`` part of an OpenAI-style response: method, tokens, exactness and statistics."""
    return {
        "retriever": job.source,
        "method": job.method,
        "tokens": res.tokens,
        "exact": res.exact,
        "stats": res.stats_dict(),
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


def _explicit_spec_fields(opts: RalmOptions, names: tuple[str, ...]) -> dict:
    """The SpecConfig fields among ``names`` that the request itself set: the top-level
    ``prefetch_size``, a spec object's fields, a spec name's ``;FIELD=VALUE`` settings."""
    out: dict = {}
    if isinstance(opts.spec, str):
        for setting in opts.spec.split(";")[1:]:
            key, eq, value = (x.strip() for x in setting.partition("="))
            if eq and key in names:
                out[key] = value
    elif isinstance(opts.spec, BaseModel):
        out.update({k: v for k, v in opts.spec.model_dump(exclude_none=True).items() if k in names})
    if opts.prefetch_size is not None and "prefetch_size" in names:
        out["prefetch_size"] = opts.prefetch_size
    return out


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
) -> RalmJob:
    """The :class:`~ralm.job.RalmJob` of a validated body, with the server's defaults applied: the
    one place a request's options are resolved. The default retriever is the first of
    ``kinds`` (the server's configured order). ``features``: ``{"dense_drafting": bool,
    "knnlm": bool}`` of the generator. Raises :class:`ApiError` (400) for any invalid or
    unavailable option."""
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

    spec_base = spec_defaults
    if knn_method and opts.spec is None:
        # a KNN-LM request that names no configuration gets KNN-LM's default (PS), with the
        # server's other SpecConfig fields underneath (its P/S/A are document-level defaults)
        spec_base = SpecConfig.parse(C.KNN_DEFAULT_SPEC, **spec_defaults.model_dump())
    if isinstance(opts.spec, str):
        try:  # the one configuration grammar (CLI, benchmarks, eval); the server's fields underneath
            spec_base = SpecConfig.parse(opts.spec, **spec_defaults.model_dump())
        except ValueError as e:
            raise ApiError(400, str(e), param="spec") from None
    spec_upd: dict = opts.spec.model_dump(exclude_none=True) if isinstance(opts.spec, BaseModel) else {}
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
        asks_async = spec_upd.get("async_verify") or (isinstance(opts.spec, str) and spec_base.async_verify)
        if asks_async and not info.async_verify:
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
    spec = _validated(SpecConfig, {**spec_base.model_dump(), **spec_upd})
    req = _validated(RequestConfig, {**base_req.model_dump(), **req_upd})
    if req.drafting == "dense" and not features.get("dense_drafting"):
        raise _not_enabled(
            "dense drafting",
            "no DReSD datastore is configured (app config dense_drafting.datastore); use drafting 'ngram' or 'none'",
            "drafting",
        )
    knn = None
    if knn_method:
        knn_upd = opts.knn.model_dump() if opts.knn is not None else {}
        # KNN-LM reads its prefetch size (entries) and stride cap from its own config: a
        # request's explicit prefetch_size / max_stride (top level, spec object or ;FIELD=VALUE)
        # go there unless its knn options set them
        for name, value in _explicit_spec_fields(opts, ("prefetch_size", "max_stride")).items():
            if knn_upd.get(name) is None:
                knn_upd[name] = value
        knn = KnnRequestOptions.model_validate(knn_upd)
        try:  # the request's settings on the server's: a 400 now, not in the replica
            knn.applied_to(knn_defaults or KnnLMConfig())
        except ValidationError as e:
            raise _prefixed_error(e, "knn.") from None
    return RalmJob(
        question=question,
        retriever=None if knn_method else kind,
        method=method,
        spec=spec,
        request=req,
        knn=knn,
        request_id=request_id(rid),
    )
