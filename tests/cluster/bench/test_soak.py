"""``ralmspec bench soak``'s loop and report, against the real HTTP app served by uvicorn over the
in-process backend (no Ray: the soak's own logic is what is tested; its 30-minute run over
the served topology is a benchmark whose result is in docs/results/)."""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import pytest

from cluster.bench.soak import Recorder, run_soak, summarize, window_stats
from cluster.bench.soak_report import plot, to_markdown
from deployments.ingress import build_http_app
from tests.deployments.serving import free_port
from tests.deployments.test_ingress_http import InProcessBackend, settings


class DriftingBackend(InProcessBackend):
    """Answers the same question differently after a while: a soak must catch it."""

    def __init__(self, drift_after: int):
        super().__init__()
        self.drift_after = drift_after

    def _result(self, job, on_commit=None):
        out = super()._result(job, on_commit)
        if len(self.jobs) > self.drift_after:
            return dataclasses.replace(out, tokens=out.tokens[:-1] + [out.tokens[-1] + 1])
        return out


@pytest.fixture
def live_app():
    uvicorn = pytest.importorskip("uvicorn")
    servers = []

    def start(backend):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_http_app(backend, settings()), port=port, log_level="warning"))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.05)
        servers.append((server, th))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, th in servers:
        server.should_exit = True
        th.join(timeout=10)


def _args(**over):
    base = dict(minutes=0.05, concurrency=3, interval=1.0, max_new_tokens=6, state_url=None, seed=1)
    return argparse.Namespace(**{**base, **over})


QUESTIONS = ["what does json dumps do", "how to join two paths", "copy a directory tree"]


def test_a_short_soak_records_every_kind_of_request_and_checks_exactness(live_app, tmp_path):
    backend = InProcessBackend()
    url = live_app(backend)
    res = run_soak(url, _args(), QUESTIONS, ["edr", "sr"])
    s = summarize(res)
    assert s["requests"] >= 10 and s["wrong_answers"] == 0 and s["lost"] == 0 and s["hung_clients"] == 0
    assert set(s["by_kind"]) >= {"spec", "seq"}, s["by_kind"]
    assert s["by_outcome"] == {"ok": s["requests"]}, s["by_outcome"]  # bad requests got their 4xx
    assert s["answers_checked"] >= 5
    assert len(res["samples"]) >= 3 and all("processes" in x and "server" in x for x in res["samples"])
    assert res["samples"][-1]["driver_rss_mib"] > 0
    meta = dict(
        url=url,
        minutes=0.05,
        concurrency=3,
        interval_s=1.0,
        retrievers=["edr", "sr"],
        max_new_tokens=6,
        state_url=False,
        machine="test machine",
    )
    md = to_markdown(meta, s, res["samples"])
    assert "wrong: **0**" in md and "## Samples" in md
    plot(res["samples"], res["events"], res["start"], tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_shed_requests_are_retried_after_retry_after_and_counted(live_app):
    """The server sheds the first requests (503 + Retry-After, or a stream's ``overloaded``
    event): the soak sends them again after that delay, as a real client does, so none is a
    failure, and the retries are counted in the summary, the samples and the report."""
    from ralm.errors import Overloaded
    from tests.deployments.test_ingress_http import SheddingBackend

    backend = SheddingBackend([Overloaded("the server is at capacity; retry later", 0.2) for _ in range(3)])
    res = run_soak(live_app(backend), _args(), QUESTIONS, ["edr"])
    s = summarize(res)
    assert s["by_outcome"] == {"ok": s["requests"]}, s["by_outcome"]
    assert s["retries"] == 3 and s["retries_gave_up"] == 0 and s["wrong_answers"] == 0, s
    assert sum(x.get("retries", 0) for x in res["samples"]) <= 3
    meta = dict(
        url="u",
        minutes=0.05,
        concurrency=3,
        interval_s=1.0,
        retrievers=["edr"],
        max_new_tokens=6,
        state_url=False,
        machine="test machine",
    )
    assert "retries of shed requests (503/429 with Retry-After, sent again after that delay): 3" in to_markdown(
        meta, s, res["samples"]
    )


def test_a_drifting_answer_is_reported_as_wrong(live_app):
    url = live_app(DriftingBackend(drift_after=6))
    res = run_soak(url, _args(minutes=0.06), QUESTIONS[:1], ["edr"])
    s = summarize(res)
    assert s["wrong_answers"] >= 1 and res["mismatches"][0]["question"] == QUESTIONS[0]


def test_window_statistics():
    ev = [(1.0, "spec", "ok", 2.0), (1.5, "seq", "ok", 4.0), (2.5, "stream", "http_500", 9.0), (3.5, "bad", "ok", 0.1)]
    w = window_stats(ev, 1.0, 3.0)
    assert (w["requests"], w["ok"], w["success_rate"]) == (3, 2, round(2 / 3, 4))
    assert w["p50_s"] in (2.0, 4.0) and w["p99_s"] == 4.0
    assert window_stats(ev, 10, 20)["success_rate"] is None
    rec = Recorder()
    assert rec.check("q", "edr", [1, 2], "seq") and rec.check("q", "edr", [1, 2], "spec")
    assert not rec.check("q", "edr", [1, 3], "stream") and rec.mismatches == [
        {"question": "q", "retriever": "edr", "how": "stream"}
    ]


def test_redis_samples_count_request_checkpoints_apart_from_other_keys(tmp_path, monkeypatch):
    """A real redis-server: the soak's key sample separates checkpoints (which must not pile
    up) from the KB cache's keys (which grow with the distinct queries)."""
    from cache.state import KBKey, RequestCheckpoint, open_state_store
    from cluster.bench.soak import _redis_keys
    from tests.cache.redis_server import RedisServer

    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD_FILE", raising=False)
    assert _redis_keys(None) == (None, None)
    srv = RedisServer(tmp_path / "redis").start()
    try:
        store = open_state_store(srv.url)
        store.put_kb_hits([(KBKey("edr", "v1", f"q{i}", 1), [(i, 1.0)]) for i in range(5)])
        for i in range(3):
            store.save_checkpoint(RequestCheckpoint(f"r{i}", [1, 2, 3], [7], 1, prompt_len=2))
        assert _redis_keys(srv.url) == (8, 3)
        store.delete_checkpoint("r0")
        assert _redis_keys(srv.url) == (7, 2)
    finally:
        srv.stop()
    assert _redis_keys(srv.url) == (None, None)  # a server that is gone: no sample, no crash
