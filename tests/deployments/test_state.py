"""The state store in serving: request checkpoints (a coordinator killed mid-request is replaced
and the request resumes from its checkpoint with the same tokens) and the cross-request
verified-KB cache (enabling it never changes an output). One app over a SQLite store."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from cluster.http_retry import send_with_retry
from ralm.config import RequestConfig, SpecConfig
from ralm.seq import run_seq
from tests.deployments.serving import app_args, serve_app

LONG = RequestConfig(max_new_tokens=64, generation_stride=1, ignore_eos=True)  # server default: long requests
SHORT = {"max_new_tokens": 24, "generation_stride": 4}
KINDS = ("edr", "sr")


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir):
    from cache.state import open_state_store
    from tests.actors.support import stop_ray

    db = tmp_path_factory.mktemp("state") / "state.db"
    url = f"sqlite://{db}"
    args = app_args(
        tmp_path_factory.mktemp("state-work"),
        index_dirs,
        fixture_corpus,
        gen_model_dir,
        KINDS,
        LONG,
        state={"store": {"url": url}, "kb_cache": ["edr"]},
    )
    base = serve_app(args)
    store = open_state_store(url)
    with httpx.Client(base_url=base, timeout=300) as client:
        yield {"client": client, "store": store}
    stop_ray()


def _coordinators():
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "ralmspec" and a["name"].startswith("coordinator-")
    ]
    return {n: ray.get_actor(n, namespace="ralmspec") for n in names}


def test_stats_report_the_store(server):
    st = server["client"].get("/v1/ralm/stats").json()["state"]
    assert st["store"].startswith("sqlite:") and st["checkpoints"] is True and st["kb_cache"] == ["edr"]


@pytest.mark.parametrize("method,spec", [("seq", None), ("spec", "PSA")])
def test_killed_coordinator_resumes_from_checkpoint(
    server, local_generator, retrievers, fixture_questions, method, spec
):
    import ray

    q = fixture_questions[1]
    want = run_seq(q, local_generator, retrievers["sr"], LONG)
    rid = f"kill-{method}-{uuid.uuid4().hex[:8]}"
    body = {"question": q, "retriever": "sr", "method": method}
    if spec:
        body["spec"] = spec
    box = {}

    def call():  # a shed answer (503 + Retry-After) is retried as a real client would, with the same id
        res = send_with_retry(
            lambda: server["client"].post("/v1/ralm/generate", json=body, headers={"X-Request-ID": rid})
        )
        box["r"], box["retries"] = res.response, res.retries

    t = threading.Thread(target=call)
    t.start()
    store = server["store"]
    deadline = time.time() + 120
    cp = None
    while time.time() < deadline and t.is_alive():
        cp = store.load_checkpoint(rid)
        if cp is not None and cp.steps >= 3:
            break
        time.sleep(0.01)
    assert cp is not None and cp.steps >= 3, "the request finished (or never checkpointed) before the kill"
    victim = cp.meta["coordinator"]
    assert victim.startswith("coordinator-")
    ray.kill(ray.get_actor(victim, namespace="ralmspec"), no_restart=True)
    t.join(600)
    r = box["r"]
    print(f"retries of the shed request: {box['retries']}")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == rid
    assert out["tokens"] == want.tokens  # the same final answer
    assert out["stats"]["doc_ids"] == want.stats.doc_ids
    assert out["stats"]["resumed_tokens"] >= cp.steps > 0  # resumed from a non-empty checkpoint
    assert out["stats"]["resumed_steps"] >= 3
    assert store.load_checkpoint(rid) is None  # dropped once the request completed
    assert victim not in _coordinators()


def test_checkpoint_of_another_job_is_ignored(server, local_generator, retrievers, fixture_questions):
    """A request id reused for a different request does not resume from the other's prefix."""
    from cache.state import RequestCheckpoint

    q = fixture_questions[2]
    rid = f"reuse-{uuid.uuid4().hex[:8]}"
    server["store"].save_checkpoint(
        RequestCheckpoint(
            request_id=rid, tokens=[1, 2, 3, 4, 5], doc_ids=[0], steps=1, prompt_len=2, meta={"job": "other"}
        )
    )
    r = server["client"].post(
        "/v1/ralm/generate",
        json={"question": q, "retriever": "edr", "method": "seq", **SHORT},
        headers={"X-Request-ID": rid},
    )
    assert r.status_code == 200, r.text
    want = run_seq(q, local_generator, retrievers["edr"], RequestConfig(**SHORT, ignore_eos=True))
    assert r.json()["tokens"] == want.tokens and r.json()["stats"]["resumed_tokens"] == 0


def test_bad_request_id_is_400(server):
    r = server["client"].post(
        "/v1/ralm/generate", json={"question": "hi", **SHORT}, headers={"X-Request-ID": "no spaces allowed"}
    )
    assert r.status_code == 400 and "X-Request-ID" in r.json()["error"]["message"]


def test_kb_cache_never_changes_outputs(server, local_generator, retrievers, fixture_questions):
    """edr has the verified-KB cache on, sr off: both return exactly RaLMSeq's tokens, twice."""
    c = server["client"]
    req = RequestConfig(**SHORT, ignore_eos=True)
    for kind in KINDS:
        for q in fixture_questions[:3]:
            want = run_seq(q, local_generator, retrievers[kind], req)
            for _ in range(2):  # the second time, edr's KB results come from the cache
                for method, spec in (("seq", None), ("spec", "PSA"), ("spec", SpecConfig(stride=3).model_dump())):
                    body = {"question": q, "retriever": kind, "method": method, **SHORT}
                    if spec:
                        body["spec"] = spec if isinstance(spec, str) else {"stride": 3}
                    r = c.post("/v1/ralm/generate", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["tokens"] == want.tokens, (kind, q, method, spec)
    import ray

    infos = [ray.get(h.info.remote()) for h in _coordinators().values()]
    hits = sum(i["kb_cache"].get("edr", {}).get("hits", 0) for i in infos)
    assert hits > 0, infos
    assert all("sr" not in i["kb_cache"] for i in infos)
