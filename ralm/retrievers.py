"""The registry of retriever kinds: one :class:`RetrieverEntry` per kind ('edr', 'adr', 'sr', ...).

Every part of ralmspec that behaves differently by retriever asks the kind's entry, never
compares its name: how its index is built, validated and loaded, how it is split into shards
and scored over them (its :class:`Family`), whether its ranking is exact, whether the flat
dense scans apply to it, in which order the server builds it, and whether its shards take a GPU.

Where the entries come from. This module imports nothing of the retrievers themselves (the
configuration validates kinds against it, and the retrievers import the configuration). Its
*providers* are modules that call :func:`register` when imported: the built-in kinds'
(:mod:`ralm.retrieval.kinds`), then any named in the environment variable
``RALMSPEC_RETRIEVER_PLUGINS`` (comma-separated module names). They are imported on the first
lookup, in every process: a Ray worker inherits the variable, so a kind a plugin registers is
known to the shards, the verifiers and the coordinators as it is to the driver.

Adding a kind: a module that builds an entry (for a dense kind, its FAISS index factory; for a
new family, the family's functions) and registers it; add the module to :data:`PROVIDERS`, or
name it in ``RALMSPEC_RETRIEVER_PLUGINS``. ``tests/deployments/test_retriever_plugin.py``
serves a kind registered that way through the Ray backend.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema as cs

__all__ = [
    "PLUGINS_ENV",
    "PROVIDERS",
    "Family",
    "RetrieverEntry",
    "RetrieverKind",
    "UnknownRetrieverError",
    "check_kind",
    "entries",
    "entry",
    "kinds",
    "register",
]

PROVIDERS: tuple[str, ...] = ("ralm.retrieval.kinds",)  # modules that register the built-in kinds
PLUGINS_ENV = "RALMSPEC_RETRIEVER_PLUGINS"


class UnknownRetrieverError(ValueError):
    """The retriever kind is not registered (the message names the known kinds)."""


@dataclass(frozen=True)
class Family:
    """How the kinds of one family keep, load, shard and score their indexes.

    ``dense`` (a FAISS index over the encoder's passage vectors) and ``sparse`` (a Lucene
    index scored with BM25) are defined in :mod:`ralm.retrieval.kinds`. Each callable takes the
    kind's :class:`RetrieverEntry` first, so one family serves every kind in it.

    * ``build(entry, corpus, out_dir, cfg, manifest, **options)``: write the index files of
      ``corpus`` into ``out_dir`` and add the family's fields to ``manifest``;
    * ``index_files(out_dir)``: the files the manifest checksums;
    * ``versions()``: the library versions recorded in the manifest;
    * ``load(entry, cfg, corpus, index_dir, manifest, encoder, hint)``: the retriever over a
      validated index;
    * ``build_slice(entry, cfg, full_dir, manifest, sub_corpus, lo, hi, out_dir, progress)``:
      the index of passages ``lo..hi-1`` (a shard) of the full index at ``full_dir``;
    * ``open_slice(entry, cfg, shard_dir, n_docs, n_shards)``: a shard's retriever over its slice;
    * ``router_scorer(router, cfg, encoder)``: the KB's exact scorer as the shard router sees it
      (:mod:`ralm.retrieval.shard_scoring`), which also says how the router asks the shards.
    """

    name: str
    encodes: bool  # queries and passages go through the dense encoder (it can serve embeddings)
    build: Callable[..., None]
    index_files: Callable[..., list]
    versions: Callable[[], dict]
    load: Callable[..., Any]
    build_slice: Callable[..., None]
    open_slice: Callable[..., Any]
    router_scorer: Callable[..., Any]


@dataclass(frozen=True)
class RetrieverEntry:
    """One retriever kind.

    ``exact``: its top-k is the exact top-k of its scores over every passage (an approximate
    index such as HNSW is not). ``scan``: its index is a flat table of passage vectors, scanned
    whole: the candidate scans of ``retriever.dense_scan`` and the benchmarks' padding apply,
    and with ``exact`` a top-k is provably the first k of any larger top-K
    (:attr:`merge_k`). ``build_order``: the server builds a family's kinds in this order (the
    first dense build caches the passage vectors the others reuse). ``gpu``: its shards take
    ``sharding.num_gpus`` (a scan may run there). ``build_params``: configuration fields the
    index is built with (a different value means another index). ``index_params(cfg)``: what
    the manifest records of the build. ``new_index(dim, cfg)``: an empty FAISS index (dense
    family only).
    """

    kind: str
    family: Family
    exact: bool
    description: str
    scan: bool = False
    build_order: int = 0
    gpu: bool = False
    build_params: tuple[str, ...] = ()
    index_params: Callable[[Any], dict] = field(default=lambda cfg: {})
    new_index: Callable[[int, Any], Any] | None = None

    @property
    def merge_k(self) -> bool:
        """Whether a top-k is the first k of any larger top-K, provably (an exact scan): a
        verification batch may then answer several ``k`` with one search at the largest."""
        return self.exact and self.scan


_lock = threading.RLock()
_entries: dict[str, RetrieverEntry] = {}
_builtin: set[str] = set()  # kinds the package's own providers registered
_loaded = False
_loading = False
_view = threading.local()  # .builtin_only: kinds()/entries() leave plugins out (builtin_only())


def register(e: RetrieverEntry, *, replace: bool = False) -> RetrieverEntry:
    """Add ``e`` under ``e.kind`` (``replace``: over an existing entry of that kind)."""
    with _lock:
        if _entries.get(e.kind) is e:  # the same entry again: nothing changes
            return e
        if e.kind in _entries and not replace:
            raise ValueError(f"retriever kind {e.kind!r} is already registered")
        _entries[e.kind] = e
        if sys._getframe(1).f_globals.get("__name__") in PROVIDERS:  # registered by the package itself
            _builtin.add(e.kind)
        else:
            _builtin.discard(e.kind)
    return e


@contextlib.contextmanager
def builtin_only() -> Iterator[None]:
    """Inside the block (this thread), :func:`kinds` and :func:`entries` list the package's
    own kinds only: what the configuration reference documents, whatever plugins this process
    has loaded."""
    before = getattr(_view, "builtin_only", False)
    _view.builtin_only = True
    try:
        yield
    finally:
        _view.builtin_only = before


def _load_providers() -> None:
    global _loaded, _loading
    if _loaded:
        return
    with _lock:  # another thread waits here until the providers are in
        if _loaded or _loading:  # loading: a provider of this thread looked a kind up
            return
        _loading = True
        try:
            plugins = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
            for module in (*PROVIDERS, *plugins):
                importlib.import_module(module)
            _loaded = True
        finally:
            _loading = False


def entries() -> tuple[RetrieverEntry, ...]:
    """Every registered kind's entry, in registration order (the built-in ones first)."""
    _load_providers()
    with _lock:
        if getattr(_view, "builtin_only", False):
            return tuple(e for e in _entries.values() if e.kind in _builtin)
        return tuple(_entries.values())


def kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order: ``('edr', 'adr', 'sr', ...)``."""
    return tuple(e.kind for e in entries())


def entry(kind: str) -> RetrieverEntry:
    """The entry of ``kind``; :class:`UnknownRetrieverError` names the known kinds otherwise."""
    _load_providers()
    with _lock:
        got = _entries.get(kind)
    if got is None:
        raise UnknownRetrieverError(f"unknown retriever {kind!r}: choose one of {', '.join(kinds())}")
    return got


def check_kind(kind: str) -> str:
    """``kind`` if it is registered, else :class:`UnknownRetrieverError` (a ``ValueError``)."""
    return entry(kind).kind


class _KindSchema:
    """The JSON schema of a kind: a string, one of the kinds registered when it is generated."""

    def __get_pydantic_json_schema__(self, schema: cs.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string", "enum": list(kinds())}


RetrieverKind = Annotated[str, AfterValidator(check_kind), _KindSchema()]
"""A configuration field's type for a retriever kind: validated against the registry."""
