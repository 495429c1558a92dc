"""A retriever kind added without touching the package: registered by a plugin module
(``tests/deployments/toy_retriever.py``, named in ``RALMSPEC_RETRIEVER_PLUGINS``), its index
built, split into shards, and served over HTTP through the Ray backend; its answers are the
in-process RaLMSeq answers over the same kind, token for token."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

from ralm.config import RequestConfig, RetrieverConfig
from ralm.retrievers import PLUGINS_ENV
from ralm.seq import run_seq
from tests.deployments.serving import app_args, serve_app

PLUGIN = "tests.deployments.toy_retriever"
REQ = RequestConfig(max_new_tokens=24, generation_stride=4)


@pytest.fixture(scope="module")
def toy_index(tmp_path_factory, fixture_corpus, dense_encoder, index_dirs):
    """The toy kind's index of the fixture corpus (the passage vectors of the edr index)."""
    from ralm.retrieval.index_build import build_index
    from tests.deployments import toy_retriever  # noqa: F401  (registers "toy" in this process)

    d = tmp_path_factory.mktemp("toy-index")
    vectors = np.load(index_dirs["edr"] / "vectors.npy")
    cfg = RetrieverConfig(kind="toy")
    build_index("toy", fixture_corpus, d, cfg, progress=False, encoder=dense_encoder, vectors=vectors)
    return d


@pytest.fixture(scope="module")
def toy_local(toy_index, fixture_corpus, dense_encoder):
    from ralm.retrieval.factory import load_retriever

    return load_retriever(RetrieverConfig(kind="toy"), fixture_corpus, toy_index, encoder=dense_encoder)


@pytest.fixture(scope="module")
def client(tmp_path_factory, toy_index, fixture_corpus, gen_model_dir):
    """The app serving only the toy kind (2 shards), with the plugin named for every Ray worker."""
    import ray

    from tests.actors.support import stop_ray

    if ray.is_initialized():  # the workers must start with the plugin in their environment
        stop_ray()
    old = os.environ.get(PLUGINS_ENV)
    os.environ[PLUGINS_ENV] = PLUGIN
    try:
        work = tmp_path_factory.mktemp("toy-work")
        args = app_args(work, {"toy": toy_index}, fixture_corpus, gen_model_dir, ("toy",), REQ)
        url = serve_app(args)
        with httpx.Client(base_url=url, timeout=300) as c:
            yield c
    finally:
        stop_ray()
        if old is None:
            os.environ.pop(PLUGINS_ENV, None)
        else:
            os.environ[PLUGINS_ENV] = old


def test_toy_kind_is_registered_with_its_family(toy_local, retrievers, fixture_questions):
    from ralm import retrievers as registry

    toy = registry.entry("toy")
    assert toy.family is registry.entry("edr").family and not toy.scan and not toy.merge_k
    assert toy_local.dense_scan == "faiss" and toy_local.batch_cost_curve is None
    # an exact flat index: the same hits as the exact dense kind, whatever scan that one uses
    qs = fixture_questions[:5]
    assert toy_local.batch_search(qs, 5) == retrievers["edr"].batch_search(qs, 5)


@pytest.mark.parametrize("method,spec", [("seq", None), ("spec", "PSA")])
def test_toy_kind_served_end_to_end(client, toy_local, local_generator, fixture_questions, method, spec):
    for q in fixture_questions[:2]:
        body = {"question": q, "retriever": "toy", "method": method, **({"spec": spec} if spec else {})}
        r = client.post("/v1/ralm/generate", json=body)
        assert r.status_code == 200, r.text
        res = r.json()
        base = run_seq(q, local_generator, toy_local, REQ)
        assert res["tokens"] == base.tokens, (method, q)
        assert res["stats"]["doc_ids"] == base.stats.doc_ids
        assert res["stats"]["retriever"] == "toy"


def test_unknown_kind_names_the_served_ones(client, fixture_questions):
    r = client.post("/v1/ralm/generate", json={"question": fixture_questions[0], "retriever": "edr"})
    assert r.status_code == 400, r.text
    assert "unknown retriever 'edr': this server serves toy" in r.text
