"""Serving through a Redis outage (a real redis-server, stopped and started): the circuit
breaker answers at once with "nothing there" while Redis is down, requests keep their
exact answers without the KB cache, nothing recorded before the outage is lost, the store
is used again once it is back; and an eval job waits for the store instead of failing."""

from __future__ import annotations

import logging
import threading
import time

from cache.state import KBKey, RequestCheckpoint, StoreCachedRetriever, open_state_store
from cache.state.degrading import DegradingStore
from cluster.eval_job import record_waiting


class CountingKB:
    name = "edr"
    scorer = None

    def __init__(self):
        self.calls = 0

    def batch_search(self, queries, k):
        self.calls += 1
        return [[(len(q), 1.0)] for q in queries]


def _degrading(url: str, skipped: list[str], cooldown_s: float = 0.6) -> DegradingStore:
    return DegradingStore(
        lambda: open_state_store(url, retry_timeout_s=0.3, retry_backoff_s=0.05),
        durable=True,
        cooldown_s=cooldown_s,
        on_skip=skipped.append,
    )


def test_requests_go_on_during_an_outage_and_nothing_is_lost(fresh_redis, no_redis_password, caplog):
    skipped: list[str] = []
    store = _degrading(fresh_redis.url, skipped)
    cp = RequestCheckpoint("req-1", tokens=[1, 2, 3], doc_ids=[7], steps=1, prompt_len=2)
    store.save_checkpoint(cp)
    kb = CountingKB()
    cached = StoreCachedRetriever(kb, store, "v1")
    assert cached.batch_search(["alpha"], 1) == [[(5, 1.0)]] and kb.calls == 1
    assert cached.batch_search(["alpha"], 1) == [[(5, 1.0)]] and kb.calls == 1  # a cache hit

    fresh_redis.stop()
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        store.save_checkpoint(RequestCheckpoint("req-2", tokens=[1, 2], doc_ids=[], steps=0, prompt_len=2))
        first = time.monotonic() - t0
    assert first < 3 and store.degraded and store.outages == 1
    assert "serving without request checkpoints" in caplog.text
    t0 = time.monotonic()
    assert store.load_checkpoint("req-1") is None  # skipped: the breaker is open
    assert cached.batch_search(["alpha", "beta"], 1) == [[(5, 1.0)], [(4, 1.0)]]  # the KB answers, exactly
    assert time.monotonic() - t0 < 0.2, "calls during the cool-down must not wait for Redis"
    assert kb.calls == 2 and skipped.count("save_checkpoint") == 1 and "get_kb_hits" in skipped

    fresh_redis.start()
    time.sleep(0.7)  # the cool-down passes; the next call tries Redis again
    with caplog.at_level(logging.INFO):
        assert store.load_checkpoint("req-1").doc_ids == [7]  # recorded before the outage: kept
    assert not store.degraded and "state store is back" in caplog.text
    assert store.outages == 1 and store.stats()["skipped"] == len(skipped)
    store.save_checkpoint(RequestCheckpoint("req-3", tokens=[9, 9], doc_ids=[], steps=0, prompt_len=2))
    assert store.load_checkpoint("req-3") is not None
    assert cached.batch_search(["alpha"], 1) == [[(5, 1.0)]] and kb.calls == 2  # the cache again


def test_a_store_down_at_start_is_an_outage_not_a_crash(fresh_redis, no_redis_password):
    fresh_redis.stop()
    skipped: list[str] = []
    store = _degrading(fresh_redis.url, skipped, cooldown_s=0.3)
    assert store.get_kb_hits([KBKey("edr", "v1", "q", 1)]) == [None]
    assert store.degraded and skipped == ["get_kb_hits"] and "not reached" in store.describe()
    fresh_redis.start()
    time.sleep(0.4)
    store.put_kb_hits([(KBKey("edr", "v1", "q", 1), [(3, 0.5)])])
    assert not store.degraded
    assert store.get_kb_hits([KBKey("edr", "v1", "q", 1)]) == [[(3, 0.5)]]


def test_an_eval_job_waits_for_the_store_and_loses_nothing(fresh_redis, no_redis_password):
    store = open_state_store(fresh_redis.url, retry_timeout_s=0.2, retry_backoff_s=0.05)
    store.init_job("job", {"n": 3})
    assert record_waiting(store, "job", "a", {"v": 1}, wait_s=5)
    fresh_redis.stop()
    done: dict = {}

    def record():
        t0 = time.monotonic()
        done["ok"] = record_waiting(store, "job", "b", {"v": 2}, wait_s=30, poll_s=0.1)
        done["waited"] = time.monotonic() - t0

    t = threading.Thread(target=record)
    t.start()
    time.sleep(1.5)
    assert t.is_alive(), "the job should be waiting for the store"
    fresh_redis.start()
    t.join(30)
    assert done["ok"] and done["waited"] >= 1.4
    assert record_waiting(store, "job", "c", {"v": 3}, wait_s=5)
    assert store.finished_items("job") == {"a", "b", "c"}
    store.close()
