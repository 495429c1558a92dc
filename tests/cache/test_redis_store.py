"""Redis-specific behaviour against a real redis-server: restarts mid-job, credentials,
a missing server. The fixtures start the server (no skip; see tests/cache/conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest

from cache.state import KBKey, RequestCheckpoint, StateStoreAuthError, StateStoreUnavailable, open_state_store
from tests.cache.redis_server import free_port


def test_restart_mid_job_keeps_everything(fresh_redis, no_redis_password):
    """Items recorded before a restart survive it (appendonly), and a write issued while
    the server is down is retried until it is back."""
    store = open_state_store(fresh_redis.url, retry_timeout_s=20)
    store.init_job("job", {"questions": 10})
    for i in range(5):
        assert store.record_item("job", f"item-{i}", {"i": i})
    store.save_checkpoint(RequestCheckpoint("req", tokens=[1, 2, 3], doc_ids=[7], steps=1, prompt_len=2))
    store.put_kb_hit(KBKey("edr", "v1", "q", 1), [(7, 0.5)])

    fresh_redis.stop()  # down in the middle of the job
    done = {}

    def write_while_down():
        t0 = time.monotonic()
        done["ok"] = store.record_item("job", "item-5", {"i": 5})
        done["waited"] = time.monotonic() - t0

    t = threading.Thread(target=write_while_down)
    t.start()
    time.sleep(0.8)
    assert t.is_alive(), "the write should be retrying while the server is down"
    fresh_redis.start()
    t.join(20)
    assert done["ok"] and done["waited"] >= 0.7

    for i in range(6, 10):  # the job carries on after the restart
        assert store.record_item("job", f"item-{i}", {"i": i})
    assert store.finished_items("job") == {f"item-{i}" for i in range(10)}
    assert store.get_job_meta("job") == {"questions": 10}
    assert store.load_checkpoint("req").doc_ids == [7]
    assert store.get_kb_hit(KBKey("edr", "v1", "q", 1)) == [(7, 0.5)]

    fresh_redis.restart()  # and once more, everything is still there
    assert {k: v["i"] for k, v in store.job_results("job").items()} == {f"item-{i}": i for i in range(10)}
    assert not store.record_item("job", "item-3", {"i": -1})
    store.close()


def test_outage_longer_than_retry_budget_raises_clearly(fresh_redis, no_redis_password):
    store = open_state_store(fresh_redis.url, retry_timeout_s=0.6, retry_backoff_s=0.05)
    store.record_item("job", "a", {"v": 1})
    fresh_redis.stop()
    t0 = time.monotonic()
    with pytest.raises(StateStoreUnavailable, match="unreachable for 1 s|unreachable for 0 s|rerun the job"):
        store.record_item("job", "b", {"v": 2})
    assert 0.5 <= time.monotonic() - t0 < 5
    fresh_redis.start()
    assert store.finished_items("job") == {"a"}
    store.close()


def test_missing_server_fails_at_startup(no_redis_password):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(
        StateStoreUnavailable,
        match=rf"cannot reach the Redis state store at redis://127\.0\.0\.1:{port}/0.*make system-deps",
    ):
        open_state_store(f"redis://127.0.0.1:{port}/0", connect_timeout_s=1)
    assert time.monotonic() - t0 < 5


def test_wrong_password_fails_at_startup(redis_with_password, monkeypatch):
    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD_FILE", raising=False)
    monkeypatch.setenv("RALMSPEC_REDIS_PASSWORD", "not-the-password")
    with pytest.raises(StateStoreAuthError, match="rejected the password from RALMSPEC_REDIS_PASSWORD") as ei:
        open_state_store(redis_with_password.url)
    assert "not-the-password" not in str(ei.value)


def test_missing_password_fails_at_startup(redis_with_password, no_redis_password):
    with pytest.raises(StateStoreAuthError, match="requires a password and none was given.*RALMSPEC_REDIS_PASSWORD"):
        open_state_store(redis_with_password.url)


def test_password_from_env_and_file(redis_with_password, monkeypatch, tmp_path):
    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD_FILE", raising=False)
    monkeypatch.setenv("RALMSPEC_REDIS_PASSWORD", redis_with_password.password)
    s = open_state_store(redis_with_password.url)
    assert s.record_item("j", "a", {"v": 1})
    s.close()

    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD")
    secret = tmp_path / "secret" / "password"  # a Kubernetes Secret volume file
    secret.parent.mkdir()
    secret.write_text(redis_with_password.password + "\n")
    monkeypatch.setenv("RALMSPEC_REDIS_PASSWORD_FILE", str(secret))
    s = open_state_store(redis_with_password.url)
    assert s.finished_items("j") == {"a"}
    redis_with_password.restart()  # re-authenticates after a restart
    assert s.record_item("j", "b", {"v": 2})
    s.close()

    monkeypatch.setenv("RALMSPEC_REDIS_PASSWORD", "x")
    with pytest.raises(ValueError, match="set only one"):
        open_state_store(redis_with_password.url)


def test_key_prefix_isolates_deployments(redis_server, no_redis_password):
    a = open_state_store(redis_server.url, key_prefix="deploy-a")
    b = open_state_store(redis_server.url, key_prefix="deploy-b")
    a.record_item("job", "x", {"v": "a"})
    assert b.finished_items("job") == set()
    assert b.record_item("job", "x", {"v": "b"})
    assert a.get_item("job", "x") == {"v": "a"}
    a.delete_job("job"), b.delete_job("job")
    a.close(), b.close()


def test_startup_wait_bridges_a_slow_server(tmp_path, no_redis_password):
    from tests.cache.redis_server import RedisServer

    srv = RedisServer(tmp_path / "late")
    threading.Timer(0.7, srv.start).start()
    try:
        s = open_state_store(srv.url, startup_wait_s=15, connect_timeout_s=1)
        assert s.record_item("j", "a", {})
        s.close()
    finally:
        time.sleep(0.1)
        srv.stop()
