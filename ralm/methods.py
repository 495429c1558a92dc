"""The request methods a server runs: one table, used by the API, the app config, the
coordinator and the KNN-LM server alike.

A method names the loop that answers a request:

- ``seq`` - RaLMSeq (:func:`ralm.seq.run_seq`): one KB retrieval every ``k`` tokens;
- ``spec`` - RaLMSpec (:func:`ralm.spec.run_spec`): speculative retrieval from a local
  cache, verified against the KB in batches; its tokens equal ``seq``'s;
- ``knnlm-seq`` / ``knnlm-spec`` - KNN-LM (:mod:`ralm.knnlm`), a token-level loop over a
  token datastore, without / with speculative retrieval (it needs the model's hidden state
  at every token, so a server runs it next to the model).

The names are the JSON wire values (``"method": "spec"``); :data:`MethodName` is the
matching ``Literal`` for request bodies and configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ralm.errors import RalmInputError


@dataclass(frozen=True)
class MethodInfo:
    """One request method: what it is, and which options apply to it."""

    name: str  # the wire value
    knn: bool  # a KNN-LM (token-level) loop, not a document-level RaLM loop
    speculative: bool  # takes RaLMSpec options (SpecConfig)
    async_verify: bool  # asynchronous verification (A) is supported
    description: str


_TABLE = (
    MethodInfo("seq", knn=False, speculative=False, async_verify=False, description="RaLMSeq"),
    MethodInfo("spec", knn=False, speculative=True, async_verify=True, description="RaLMSpec"),
    MethodInfo(
        "knnlm-seq", knn=True, speculative=False, async_verify=False, description="KNN-LM without speculative retrieval"
    ),
    MethodInfo(
        "knnlm-spec", knn=True, speculative=True, async_verify=False, description="KNN-LM with speculative retrieval"
    ),
)

METHODS: dict[str, MethodInfo] = {m.name: m for m in _TABLE}
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)
KNN_METHODS: tuple[str, ...] = tuple(m.name for m in _TABLE if m.knn)
DOCUMENT_METHODS: tuple[str, ...] = tuple(m.name for m in _TABLE if not m.knn)  # what ralm.pipeline runs

MethodName = Literal["seq", "spec", "knnlm-seq", "knnlm-spec"]
# the Literal is spelled out for type checkers; it must list exactly the table's names
if get_args(MethodName) != METHOD_NAMES:  # pragma: no cover - a broken edit of this file
    raise ImportError(f"MethodName {get_args(MethodName)} does not list the method table's names {METHOD_NAMES}")


def method_info(name: str) -> MethodInfo:
    """The :class:`MethodInfo` of ``name``; :class:`~ralm.errors.RalmInputError` if unknown."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise RalmInputError(f"unknown method {name!r}: use one of {', '.join(METHOD_NAMES)}") from None


def is_knn(name: str) -> bool:
    """Whether ``name`` is a KNN-LM method (False for unknown names)."""
    info = METHODS.get(name) if isinstance(name, str) else None
    return bool(info and info.knn)


def describe_methods() -> str:
    """``"seq: RaLMSeq; spec: RaLMSpec; ..."`` (for API and config field descriptions)."""
    return "; ".join(f"{m.name}: {m.description}" for m in _TABLE)


__all__ = [
    "DOCUMENT_METHODS",
    "KNN_METHODS",
    "METHODS",
    "METHOD_NAMES",
    "MethodInfo",
    "MethodName",
    "describe_methods",
    "is_knn",
    "method_info",
]
