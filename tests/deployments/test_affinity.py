"""Session affinity over real Ray Serve: with 2 generator replicas, every step of a request
goes to one replica (its session key is Serve's multiplexed model id), the tokens are
RaLMSeq's alone, the request's KV sessions are released on that replica when it ends, and
keys evicted from Serve's multiplexed LRU release their sessions too."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from ralm.config import RequestConfig
from ralm.seq import run_seq
from ralm.step_request import StepRequest
from tests.deployments.serving import app_args, serve_app

REQ = RequestConfig(max_new_tokens=24, generation_stride=4)
KIND = "edr"
MAX_KEYS = 2  # a small multiplexed LRU, so that the eviction test evicts


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir):
    from ray import serve

    from tests.actors.support import stop_ray

    args = app_args(
        tmp_path_factory.mktemp("affinity-work"),
        index_dirs,
        fixture_corpus,
        gen_model_dir,
        (KIND,),
        REQ,
        generator_deployment={"num_cpus": 0.2, "num_replicas": 2, "session_keys_per_replica": MAX_KEYS},
        pool={"size": 1, "max_size": 2},
    )
    base = serve_app(args)
    handle = serve.get_deployment_handle("Generator", app_name="ralmspec")
    with httpx.Client(base_url=base, timeout=300) as client:
        yield {"client": client, "gen": handle}
    stop_ray()


def _replicas(handle, tries: int = 40) -> dict[int, dict]:
    """pid -> info() of each generator replica (Serve spreads unkeyed calls over both)."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        info = handle.info.remote().result(timeout_s=60)
        seen[info["pid"]] = info
        if len(seen) == 2:
            break
    assert len(seen) == 2, "expected 2 generator replicas"
    return seen


def _keys(replicas: dict[int, dict]) -> dict[str, list[tuple[int, dict]]]:
    """session key -> [(replica pid, its record of the key)] over the replicas that saw it."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for pid, info in replicas.items():
        for key, rec in info["session_keys"]["recent"].items():
            out.setdefault(key, []).append((pid, rec))
    return out


def test_each_request_stays_on_one_replica_and_is_released(server, local_generator, retrievers, fixture_questions):
    client, gen = server["client"], server["gen"]
    before = _keys(_replicas(gen))
    steps_before = sum(i["steps"] for i in _replicas(gen).values())
    jobs = [(q, m) for q in fixture_questions[:2] for m in ("seq", "spec")]
    for q, method in jobs:
        r = client.post("/v1/ralm/generate", json={"question": q, "retriever": KIND, "method": method})
        assert r.status_code == 200, r.text
        want = run_seq(q, local_generator, retrievers[KIND], REQ)
        assert r.json()["tokens"] == want.tokens, (q, method)  # (b) RaLMSeq's tokens alone

    # the release is fire-and-forget: wait until every new key is released
    deadline = time.monotonic() + 30
    while True:
        replicas = _replicas(gen)
        new = {k: v for k, v in _keys(replicas).items() if k not in before}
        if len(new) >= len(jobs) and all(rec["released"] is not None for recs in new.values() for _, rec in recs):
            break
        assert time.monotonic() < deadline, "\n".join(f"{k}: {v}" for k, v in new.items())
        time.sleep(0.2)
    assert len(new) == len(jobs)
    for key, recs in new.items():
        assert len(recs) == 1, f"the steps of {key} went to {len(recs)} replicas"  # (a)
        (_, rec) = recs[0]
        assert rec["steps"] >= 2 and rec["loads"] == 1
        assert rec["released"] >= 1 and not rec["evicted"] and rec["held"] == 0  # (c)
    # every step of these requests carried its request's key
    steps = sum(i["steps"] for i in replicas.values()) - steps_before
    assert steps == sum(rec["steps"] for recs in new.values() for _, rec in recs)
    assert sum(i["session_keys"]["released"] for i in replicas.values()) >= len(jobs)


def test_evicted_keys_release_their_sessions(server, local_generator, fixture_questions):
    gen = server["gen"]
    tok = local_generator.engine.tokenizer
    ctx = tok(fixture_questions[0], add_special_tokens=False)["input_ids"]
    keys = [f"evict-{uuid.uuid4().hex[:8]}-{i}" for i in range(3 * MAX_KEYS)]
    # one step each, over its own document: it leaves one session tagged with the key (a
    # step with the same documents would take over the previous key's session)
    for doc, key in enumerate(keys, start=30):
        req = StepRequest(tuple(ctx), 4, doc_ids=doc)
        out = gen.options(multiplexed_model_id=key).step.remote(req).result(timeout_s=60)
        assert out.tokens == local_generator.step(doc, ctx, 4).tokens
    seen = _keys(_replicas(gen))
    recs = [rec for key in keys for _, rec in seen.get(key, [])]
    # 2 replicas keep at most MAX_KEYS keys each: the others were evicted, and released
    evicted = [rec for rec in recs if rec["evicted"]]
    assert len(evicted) >= len(keys) - 2 * MAX_KEYS
    assert all(rec["released"] is not None and rec["held"] == 0 for rec in evicted)
    assert sum(rec["released"] for rec in evicted) >= len(keys) - 2 * MAX_KEYS
    # the keys still loaded keep their sessions until released
    for key in keys:
        for _, rec in seen.get(key, []):
            if not rec["evicted"]:
                assert rec["held"] >= 1
                assert gen.options(multiplexed_model_id=key).release.remote(key).result(timeout_s=60) >= 0


def test_a_release_for_unknown_sessions_is_harmless(server):
    n = server["gen"].options(multiplexed_model_id="never-seen").release.remote("never-seen").result(timeout_s=60)
    assert n == 0


def test_a_key_is_released_once_whether_its_request_ends_or_serve_evicts_it():
    from deployments.affinity import SessionKeys

    held = {"a": 2, "b": 1}
    keys = SessionKeys(lambda k: held.pop(k, 0), lambda k: held.get(k, 0), 4)
    lease_a, lease_b = keys._loaded("a"), keys._loaded("b")  # what the multiplexed loader returns to Serve
    assert keys.release("a") == 2  # the request ended
    lease_a.__del__()  # Serve evicts the key later: nothing left to release
    lease_b.__del__()  # evicted while its request still held a session
    lease_b.__del__()  # (and Python may call it again)
    info = keys.info()
    assert info["recent"]["a"] == {"steps": 0, "loads": 1, "released": 2, "evicted": False, "held": 0}
    assert info["recent"]["b"] == {"steps": 0, "loads": 1, "released": 1, "evicted": True, "held": 0}
    assert (info["released"], info["evicted"], info["sessions_released"]) == (1, 1, 3)
    assert keys.release("never-seen") == 0
