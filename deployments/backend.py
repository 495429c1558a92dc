"""What the HTTP ingress needs of the system behind it: the :class:`RalmBackend` protocol.

The ingress (:mod:`deployments.ingress`) only speaks HTTP - routes, auth, validation,
server-sent events, error mapping - and hands every validated job to a backend. The
served backend is :class:`deployments.ray_backend.RayBackend` (shards, verifiers, a pool
of coordinator actors, the generator deployment); tests use an in-process one over the
core loops. Nothing here imports Ray.

A *job* is the :class:`~ralm.job.RalmJob` :func:`deployments.api.build_job` makes, every
option resolved; backends pass it on as it is. A *result* is the frozen
:class:`~ralm.results.RalmResult` the core loop made (a served one with ``queue_s``); the
ingress builds the HTTP response from it. A stream yields ``{"delta": text, "tokens": [...]}``
chunks as tokens are verified (the deltas concatenate to the text), then ``{"delta": text,
"tokens": [], "done": True, "result": result}``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from ralm.job import RalmJob
from ralm.results import RalmResult


class BackendUnavailable(Exception):
    """The backend cannot serve now (``/healthz`` answers 503 with this reason)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@runtime_checkable
class RalmBackend(Protocol):
    """The operations the ingress calls. Errors a request can cause (bad input, an option the
    server cannot run) are raised as :class:`~ralm.errors.RalmInputError` or
    :class:`~ralm.errors.ConfigError` (the ingress answers 400); anything else is a 500."""

    features: dict[str, bool]  # optional modes the generator serves: {"dense_drafting", "knnlm"}
    max_prompt_tokens: int  # longest accepted question, in tokens
    max_new_tokens: int  # most tokens a request may ask for

    def encode_question(self, question: str) -> list[int]:
        """The question's token ids with the generator's tokenizer (RalmInputError when it is
        empty or too long); the ingress checks prompts with it before any work starts."""
        ...

    def chat_prompt(self, messages: list) -> str:
        """The prompt text of chat ``messages`` under the generator's chat template
        (:func:`ralm.chat.chat_prompt`); RalmInputError for messages it cannot render."""
        ...

    async def embed(self, texts: list[str]) -> tuple[Any, list[int]]:
        """``/v1/embeddings``: the dense encoder's vectors ``(n, dim)`` float32 and each text's
        token count; RalmInputError when no dense retriever is served or a text is too long."""
        ...

    async def run(self, job: RalmJob) -> RalmResult:
        """Answer one job; returns its result."""
        ...

    def stream(self, job: RalmJob) -> AsyncGenerator[dict, None]:
        """Answer one job chunk by chunk (an async generator). Closing it early (the client
        went away) cancels the request: the backend frees what it holds once the request
        is done. The ingress sends the response headers only after the first chunk, so a
        request refused when it is admitted (:class:`~ralm.errors.Overloaded`, bad input)
        gets its status and ``Retry-After`` like a non-streamed one: a backend that admits
        a request before its first tokens yields an empty chunk (``delta`` "") then."""
        ...

    async def health(self) -> dict:
        """Extra fields of a healthy ``/healthz`` answer; raises :class:`BackendUnavailable`."""
        ...

    async def stats(self) -> dict:
        """Statistics of the parts behind the ingress (``/v1/ralm/stats``)."""
        ...

    async def configure_verifiers(self, policy: dict, reset_stats: bool = False) -> dict:
        """Set the given verifier batching policy fields on every retriever's verifier (the
        admin API); returns ``{retriever: policy now in force}``."""
        ...


# how the Serve deployment gets its backend: ``await factory(app_config, *args)`` in the replica
BackendFactory = Callable[..., Awaitable[RalmBackend]]

__all__ = ["BackendFactory", "BackendUnavailable", "RalmBackend"]
