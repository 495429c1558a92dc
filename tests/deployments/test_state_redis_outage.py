"""Redis goes down while the app serves (a real redis-server, stopped and started under a
Ray Serve app with request checkpoints and the verified-KB cache on): every request is still
answered, exactly and without waiting out the store's retry budget; the coordinators report
the outage; once Redis is back they use it again, and what was stored before is still there."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.http_retry import RetryLog, send_with_retry
from ralm.config import RequestConfig
from ralm.seq import run_seq
from tests.deployments.serving import app_args, serve_app

REQ = RequestConfig(max_new_tokens=16, generation_stride=4)
KINDS = ("edr",)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    from tests.cache.redis_server import RedisServer

    srv = RedisServer(tmp_path_factory.mktemp("redis-outage")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir, redis):
    from tests.actors.support import stop_ray

    args = app_args(
        tmp_path_factory.mktemp("outage-work"),
        index_dirs,
        fixture_corpus,
        gen_model_dir,
        KINDS,
        REQ,
        state={"store": {"url": redis.url, "serve_cooldown_s": 2.0}, "kb_cache": ["edr"]},
    )
    base = serve_app(args)
    with httpx.Client(base_url=base, timeout=300) as client:
        yield client
    stop_ray()


def _store_states() -> list[dict]:
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "ralmspec" and a["name"].startswith("coordinator-")
    ]
    infos = [ray.get(ray.get_actor(n, namespace="ralmspec").info.remote()) for n in names]
    return [i["state_store"] for i in infos if i.get("state_store")]


def _ask(client, q, method, log: RetryLog | None = None):
    """(final answer, longest send in seconds): sent as a real client sends it, a shed answer
    (503/429 with Retry-After) retried after that delay, a bounded number of times; the time
    waited between sends is not the store's, so only the sends are timed."""
    body = {"question": q, "retriever": "edr", "method": method, **({"spec": "PSA"} if method == "spec" else {})}
    res = send_with_retry(lambda: client.post("/v1/ralm/generate", json=body))
    if log is not None:
        log.add(res)
    return res.response, max(res.attempt_s)


def test_requests_are_answered_through_a_redis_outage(server, redis, local_generator, retrievers, fixture_questions):
    import redis as redis_py

    qs = fixture_questions[:4]
    want = {q: run_seq(q, local_generator, retrievers["edr"], REQ).tokens for q in qs}
    for q in qs[:2]:  # Redis up: checkpoints and the KB cache in use
        r, _ = _ask(server, q, "spec")
        assert r.status_code == 200 and r.json()["tokens"] == want[q]
    keys_before = redis_py.Redis.from_url(redis.url).dbsize()
    assert keys_before > 0

    redis.stop()
    log = RetryLog()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda a: _ask(server, *a, log=log), [(q, m) for q in qs for m in ("seq", "spec")]))
    print(f"retries of shed requests during the outage: {log.as_dict()}")
    for (r, dt), (q, _) in zip(outs, [(q, m) for q in qs for m in ("seq", "spec")]):
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want[q]
        assert dt < 25, f"a request waited {dt:.1f} s for the unreachable store"
    states = _store_states()
    assert any(s["outages"] >= 1 and s["skipped"] > 0 for s in states), states

    redis.start()
    assert redis_py.Redis.from_url(redis.url).dbsize() == keys_before  # nothing recorded was lost
    time.sleep(2.5)  # the breaker's cool-down
    for q in qs:
        r, _ = _ask(server, q, "spec")
        assert r.status_code == 200 and r.json()["tokens"] == want[q]
    states = _store_states()
    assert any(s["outages"] >= 1 and not s["degraded"] for s in states), states  # recovered
    assert redis_py.Redis.from_url(redis.url).dbsize() > keys_before  # the store is written again


def test_an_abandoned_request_leaves_no_checkpoint(server, redis, fixture_questions):
    """A client that leaves mid-stream cancels its request; its checkpoint is deleted with it
    (nobody will resume it), so abandoned requests do not pile up keys until their TTL."""
    import redis as redis_py

    r = redis_py.Redis.from_url(redis.url)

    def checkpoints() -> int:
        return sum(1 for _ in r.scan_iter(match="*:ckpt:*"))

    before = checkpoints()
    body = {"prompt": fixture_questions[5], "retriever": "edr", "method": "seq", "stream": True, "max_tokens": 16}
    seen = 0
    for i in range(3):
        with server.stream("POST", "/v1/completions", json=body, headers={"X-Request-ID": f"leave-{i}"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += r.exists(f"ralmspec:ckpt:leave-{i}")  # its checkpoint, written as it streams
                    break  # leave after the first event
    assert seen >= 1, "no checkpoint was written before the client left: the test shows nothing"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and checkpoints() > before:
        time.sleep(0.5)
    assert checkpoints() == before
