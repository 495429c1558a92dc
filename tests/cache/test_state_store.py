"""Behaviour of every state store backend: the same tests against memory, SQLite and a
real redis-server (started by tests/cache/conftest.py; no skip)."""

from __future__ import annotations

import math
import threading
import time
import uuid

import pytest

from cache.state import (
    KBKey,
    RequestCheckpoint,
    StateStoreConfig,
    StateStoreConfigError,
    StoreCachedRetriever,
    open_state_store,
)

BACKENDS = ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.integration)]


def _open(kind: str, request, tmp_path, **cfg):
    if kind == "memory":
        return open_state_store(None, **cfg)
    if kind == "sqlite":
        return open_state_store(f"sqlite://{tmp_path / 'state.db'}", **cfg)
    srv = request.getfixturevalue("redis_server")
    return open_state_store(srv.url, key_prefix=f"t-{uuid.uuid4().hex[:8]}", **cfg)


@pytest.fixture(params=BACKENDS)
def kind(request, no_redis_password):
    return request.param


@pytest.fixture
def store(kind, request, tmp_path):
    s = _open(kind, request, tmp_path)
    yield s
    s.close()


# ------------------------------------------------------------------ jobs
def test_record_item_first_write_wins(store):
    assert store.finished_items("job") == set()
    assert store.record_item("job", "q0|edr|seq", {"tokens": [1, 2, 3], "text": "héllo"})
    assert not store.record_item("job", "q0|edr|seq", {"tokens": [9]})
    assert store.record_item("job", "q0|edr|PSA", {"tokens": [1, 2, 3], "identical": True})
    assert store.finished_items("job") == {"q0|edr|seq", "q0|edr|PSA"}
    assert store.count_items("job") == 2
    assert store.get_item("job", "q0|edr|seq") == {"tokens": [1, 2, 3], "text": "héllo"}
    assert store.get_item("job", "missing") is None
    assert store.job_results("job") == {
        "q0|edr|seq": {"tokens": [1, 2, 3], "text": "héllo"},
        "q0|edr|PSA": {"tokens": [1, 2, 3], "identical": True},
    }
    assert store.finished_items("other-job") == set()
    store.delete_job("job")
    assert store.finished_items("job") == set() and store.get_job_meta("job") is None


def test_init_job_keeps_first_meta(store):
    assert store.get_job_meta("j") is None
    assert store.init_job("j", {"model": "a", "n": 1}) == {"model": "a", "n": 1}
    assert store.init_job("j", {"model": "b"}) == {"model": "a", "n": 1}
    assert store.get_job_meta("j") == {"model": "a", "n": 1}
    # items recorded before the meta: init_job still sets the meta
    store.record_item("k", "x", {"v": 1})
    assert store.init_job("k", {"m": 2}) == {"m": 2}


def test_record_item_is_atomic_under_concurrency(store):
    wins: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(w: int):
        for i in range(20):
            if store.record_item("race", f"item-{i}", {"writer": w}):
                with lock:
                    wins.append((w, i))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for _, i in wins) == list(range(20))  # each item won exactly once
    results = store.job_results("race")
    assert {k: v["writer"] for k, v in results.items()} == {f"item-{i}": w for w, i in wins}


def test_results_must_be_json(store):
    with pytest.raises(TypeError):
        store.record_item("j", "bad", {"x": object()})
    assert store.finished_items("j") == set()


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_roundtrip_and_monotonic(store):
    assert store.load_checkpoint("req-1") is None
    cp = RequestCheckpoint(
        "req-1",
        tokens=[5, 6, 7, 8, 9],
        doc_ids=[3, None],
        steps=2,
        prompt_len=3,
        meta={"question": "q?", "retriever": "edr", "spec": "PSA"},
    )
    assert store.save_checkpoint(cp)
    got = store.load_checkpoint("req-1")
    assert (got.tokens, got.doc_ids, got.steps, got.prompt_len, got.meta) == ([5, 6, 7, 8, 9], [3, None], 2, 3, cp.meta)
    assert got.updated_at > 0
    newer = RequestCheckpoint("req-1", tokens=[5, 6, 7, 8, 9, 10], doc_ids=[3, None, 4], steps=3, prompt_len=3)
    assert store.save_checkpoint(newer)
    stale = RequestCheckpoint("req-1", tokens=[5, 6, 7], doc_ids=[3], steps=1, prompt_len=3)
    assert not store.save_checkpoint(stale)  # a stale coordinator cannot regress it
    assert store.load_checkpoint("req-1").steps == 3
    store.delete_checkpoint("req-1")
    assert store.load_checkpoint("req-1") is None


def test_checkpoint_validation():
    with pytest.raises(ValueError):
        RequestCheckpoint("r", tokens=[1], doc_ids=[1, 2], steps=1)
    with pytest.raises(ValueError):
        RequestCheckpoint("", tokens=[1], doc_ids=[], steps=0)


# ------------------------------------------------------------------ KB cache
def test_kb_hits_roundtrip_exact_floats(store):
    scores = [0.1 + 0.2, 1 / 3, -2.5e-300, math.pi, 0.0]
    k1 = KBKey("edr", "manifest-abc", "What does json.dumps do? ünïcode", 5)
    hits = [(i * 7, s) for i, s in enumerate(scores)]
    assert store.get_kb_hits([k1]) == [None]
    store.put_kb_hits([(k1, hits)])
    got = store.get_kb_hit(k1)
    assert got == hits and all(type(d) is int and type(s) is float for d, s in got)
    assert [s.hex() for _, s in got] == [s.hex() for _, s in hits]  # bit-exact (== takes -0.0 for 0.0)
    other_index = KBKey("edr", "manifest-xyz", k1.query, 5)
    other_k = KBKey("edr", "manifest-abc", k1.query, 20)
    other_ret = KBKey("sr", "manifest-abc", k1.query, 5)
    assert store.get_kb_hits([other_index, k1, other_k, other_ret]) == [None, hits, None, None]
    store.put_kb_hit(other_k, [])
    assert store.get_kb_hit(other_k) == []


def test_ttls_expire(kind, request, tmp_path):
    s = _open(kind, request, tmp_path, checkpoint_ttl_s=1, kb_cache_ttl_s=1, job_ttl_s=1)
    s.save_checkpoint(RequestCheckpoint("r", tokens=[1], doc_ids=[], steps=0))
    s.put_kb_hit(KBKey("edr", "v", "q", 1), [(1, 1.0)])
    s.record_item("j", "a", {"x": 1})
    assert s.load_checkpoint("r") is not None and s.finished_items("j") == {"a"}
    time.sleep(1.3)
    assert s.load_checkpoint("r") is None
    assert s.get_kb_hit(KBKey("edr", "v", "q", 1)) is None
    assert s.finished_items("j") == set()
    s.close()


def test_store_cached_retriever(store):
    class KB:
        name = "edr"
        scorer = None

        def __init__(self):
            self.calls: list[list[str]] = []

        def batch_search(self, queries, k):
            self.calls.append(list(queries))
            return [[(len(q), 1.0 / len(q))][:k] for q in queries]

    kb = KB()
    cached = StoreCachedRetriever(kb, store, index_version="v1")
    assert cached.batch_search(["aa", "bbb"], 1) == [[(2, 0.5)], [(3, 1 / 3)]]
    assert cached.batch_search(["bbb", "cccc"], 1) == [[(3, 1 / 3)], [(4, 0.25)]]
    assert cached.search("aa", 1) == [(2, 0.5)]
    assert kb.calls == [["aa", "bbb"], ["cccc"]]  # only misses reach the KB
    assert (cached.hits, cached.misses) == (2, 3)
    with pytest.raises(ValueError):
        StoreCachedRetriever(kb, store, index_version="")


# ------------------------------------------------------------------ config
def test_durability_flags(kind, request, tmp_path):
    s = _open(kind, request, tmp_path)
    assert s.durable == (kind != "memory")
    assert "***" not in s.describe()
    s.close()


def test_sqlite_survives_reopen(tmp_path):
    url = f"sqlite://{tmp_path / 'sub' / 'state.db'}"
    s = open_state_store(url)
    s.init_job("j", {"a": 1})
    s.record_item("j", "x", {"v": 1})
    s.close()
    s2 = open_state_store(url)
    assert s2.get_job_meta("j") == {"a": 1} and s2.job_results("j") == {"x": {"v": 1}}
    s2.close()


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@localhost:6379/0", "redis://user:hunter2@h:1/0", "rediss://h:6380/0?password=hunter2"]
)
def test_password_in_url_rejected_without_echo(url):
    with pytest.raises(StateStoreConfigError, match="contains a password") as ei:
        open_state_store(url)
    assert "hunter2" not in str(ei.value)
    assert "RALMSPEC_REDIS_PASSWORD" in str(ei.value)


def test_password_field_in_config_rejected():
    with pytest.raises(StateStoreConfigError, match="must not contain 'password'") as ei:
        StateStoreConfig.parse({"url": "redis://h:6379/0", "password": "hunter2"})
    assert "hunter2" not in str(ei.value)
    with pytest.raises(ValueError, match="contains a password") as ei:
        StateStoreConfig(url="redis://:hunter2@h/0")
    assert "hunter2" not in str(ei.value)


def test_bad_scheme_and_defaults():
    with pytest.raises(StateStoreConfigError, match="unsupported state store URL scheme"):
        open_state_store("mysql://h/db")
    assert open_state_store("memory://").describe() == "memory://"
    assert StateStoreConfig().scheme == "memory"
    assert all(f.description for f in StateStoreConfig.model_fields.values())
