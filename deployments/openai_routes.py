"""The OpenAI routes beyond completions: ``/v1/chat/completions`` and ``/v1/embeddings``.

Chat is a completion whose prompt is the conversation rendered by the generator's chat
template (:func:`ralm.chat.chat_prompt`): the same job, the same RaLM loop, the same
exactness (its tokens are RaLMSeq's for that prompt), the same retrieval options as
extra body fields, and the same streaming. Only the response shapes differ
(``chat.completion`` / ``chat.completion.chunk``, the text under ``message`` / ``delta``).

Embeddings come from the dense retrievers' encoder: each input is encoded alone, exactly
as a retrieval query is, so an embedding is the vector the KB is searched with.
``encoding_format: base64`` (what the official Python client asks for) is the
little-endian float32 bytes of each vector.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np

from deployments.api import ApiError, ChatCompletionRequest, EmbeddingRequest, check_greedy, message_of, ralm_block
from ralm import constants as C
from ralm.errors import RalmInputError

if TYPE_CHECKING:
    from deployments.endpoints import Endpoints


def _check_chat_only_fields(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise ApiError(400, "tools: tool calling is not supported", param="tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice: tool calling is not supported", param="tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {'type': 'text'} is supported", param="response_format")
    if body.top_logprobs not in (None, 0):
        raise ApiError(400, "top_logprobs: logprobs are not supported", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise ApiError(
                400, "max_tokens and max_completion_tokens disagree; send one of them", param="max_completion_tokens"
            )


async def chat_completions(ep: Endpoints, body: ChatCompletionRequest, x_request_id: str | None):
    ep._check_model(body.model)
    check_greedy(body)
    _check_chat_only_fields(body)
    try:
        prompt = ep.backend.chat_prompt(list(body.messages))
    except RalmInputError as e:
        raise ApiError(400, message_of(e), param="messages") from None
    n_prompt = ep._validate_prompt(prompt, "messages")
    max_new, max_param = (
        (body.max_completion_tokens, "max_completion_tokens")
        if body.max_completion_tokens is not None
        else (body.max_tokens, "max_tokens")
    )
    job = ep._job(prompt, body, max_new, max_param, x_request_id)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    model = ep.settings.model_name
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def event(delta: dict, finish: str | None, **extra) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            return "data: " + json.dumps({**obj, "choices": [choice], **extra}) + "\n\n"

        def chunk(text: str, finish: str | None, **extra) -> str:
            return event({"content": text} if text or finish is None else {}, finish, **extra)

        return await ep._stream_response(
            job, chunk, event({"role": "assistant", "content": ""}, None), n_prompt, include_usage
        )
    res = await ep._run(job)
    n_out = len(res.tokens)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "logprobs": None,
                "finish_reason": res.finish_reason,
            }
        ],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        "ralm": {**ralm_block(job, res), "prompt": prompt},
    }


def _embedding_inputs(ep: Endpoints, body: EmbeddingRequest) -> list[str]:
    inp = body.input
    texts = [inp] if isinstance(inp, str) else list(inp)
    if not texts:
        raise ApiError(400, "input: must not be empty", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input: token arrays are not supported; send text", param="input")
    if len(texts) > C.MAX_EMBEDDING_INPUTS:
        raise ApiError(
            400, f"input: at most {C.MAX_EMBEDDING_INPUTS} texts per request, got {len(texts)}", param="input"
        )
    limit = ep.settings.max_prompt_chars
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise ApiError(400, f"input[{i}]: must be a non-empty string", param="input")
        if len(t) > limit:
            raise ApiError(400, f"input[{i}] is {len(t)} characters long; the limit is {limit}", param="input")
    return [str(t) for t in texts]


async def embeddings(ep: Endpoints, body: EmbeddingRequest):
    s = ep.settings
    if s.embedding_model is None:
        raise ApiError(
            400, "embeddings need a dense retriever (edr or adr); this server serves none", code="not_enabled"
        )
    if body.model is not None and body.model not in s.embedding_ids:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server's embedding model is {s.embedding_model!r}",
            param="model",
            code="model_not_found",
        )
    texts = _embedding_inputs(ep, body)
    ep.requests += 1
    try:
        vecs, counts = await ep.backend.embed(texts)
    except RalmInputError as e:
        ep.errors += 1
        raise ApiError(400, message_of(e), param="input") from None
    vecs = np.asarray(vecs, dtype=np.float32)  # (n, dim)
    if body.dimensions is not None and body.dimensions != vecs.shape[1]:
        raise ApiError(
            400,
            f"dimensions: this encoder makes {vecs.shape[1]}-dimensional vectors, got {body.dimensions}",
            param="dimensions",
        )
    data = []
    for i, v in enumerate(vecs):
        emb: list[float] | str = (
            base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            if body.encoding_format == "base64"
            else [float(x) for x in v]
        )
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n_tok = int(sum(counts))
    return {
        "object": "list",
        "data": data,
        "model": s.embedding_model,
        "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
    }


__all__ = ["chat_completions", "embeddings"]
