"""Real redis-server fixtures for the state store tests (see tests/cache/redis_server.py)."""

from __future__ import annotations

import pytest

from tests.cache.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A password-less server on a free loopback port, shared by a module."""
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh_redis(tmp_path):
    """A private server for tests that restart or stop it."""
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture
def redis_with_password(tmp_path):
    srv = RedisServer(tmp_path / "redis-auth", password="s3cret-Pa55").start()
    yield srv
    srv.stop()


@pytest.fixture
def no_redis_password(monkeypatch):
    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("RALMSPEC_REDIS_PASSWORD_FILE", raising=False)
