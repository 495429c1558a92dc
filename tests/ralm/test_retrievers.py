"""The registry of retriever kinds (:mod:`ralm.retrievers`): what each built-in entry says, how an
unknown kind is refused, and that the configuration validates against the registry."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ralm import retrievers
from ralm.config import RetrieverConfig
from ralm.job import RalmJob


def test_builtin_entries():
    assert retrievers.kinds()[:3] == ("edr", "adr", "sr")
    edr, adr, sr = (retrievers.entry(k) for k in ("edr", "adr", "sr"))
    assert edr.family is adr.family and edr.family.name == "dense" and edr.family.encodes
    assert sr.family.name == "sparse" and not sr.family.encodes
    assert edr.exact and edr.scan and edr.gpu and edr.merge_k
    assert not adr.exact and not adr.scan and not adr.gpu and not adr.merge_k
    assert sr.exact and not sr.scan and not sr.merge_k  # merging k is proven for an exact scan only
    assert edr.build_order < adr.build_order  # edr's build caches the vectors adr's reuses
    assert adr.build_params == ("encoder", "hnsw_m", "hnsw_ef_construction")


def test_unknown_kind():
    with pytest.raises(retrievers.UnknownRetrieverError, match="unknown retriever 'xyz': choose one of edr, adr, sr"):
        retrievers.entry("xyz")
    with pytest.raises(ValidationError, match="unknown retriever 'xyz': choose one of edr, adr, sr"):
        RetrieverConfig(kind="xyz")
    with pytest.raises(ValidationError, match="unknown retriever"):
        RalmJob(question="q", method="seq", retriever="xyz")
    assert RetrieverConfig(kind="adr").kind == "adr"


def test_register_twice_is_refused():
    edr = retrievers.entry("edr")
    with pytest.raises(ValueError, match="already registered"):
        retrievers.register(retrievers.RetrieverEntry(kind="edr", family=edr.family, exact=True, description="x"))
    assert retrievers.register(edr) is edr  # the same entry again is a no-op


def test_schema_lists_the_registered_kinds():
    prop = RetrieverConfig.model_json_schema()["properties"]["kind"]
    assert prop["enum"] == list(retrievers.kinds())


def test_a_plugin_kind_is_listed_but_not_among_the_builtin_ones(monkeypatch):
    """What the configuration reference documents (the package's own kinds) does not depend on
    the plugins a process has loaded; every other caller sees them."""
    monkeypatch.setattr(retrievers, "_entries", dict(retrievers._entries))  # undone after the test
    edr = retrievers.entry("edr")
    retrievers.register(retrievers.RetrieverEntry(kind="plugged", family=edr.family, exact=True, description="x"))
    assert retrievers.kinds()[-1] == "plugged"
    with retrievers.builtin_only():
        assert retrievers.kinds() == ("edr", "adr", "sr")
    assert "plugged" in retrievers.kinds()
