"""The Responses API's store on SQLite and PostgreSQL: JSON round trip, tenant scoping,
retention, purge, and two gateways sharing one database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tokenyard.services.gateway.responses_api.store import ResponseStore

RESPONSE = {
    "id": "resp_abc",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Grüße ☀", "annotations": [], "logprobs": []}
            ],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "f",
            "arguments": '{"x": 1}',
            "status": "completed",
        },
    ],
}
CONTEXT = [{"type": "message", "role": "user", "content": "hi"}]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'responses.db'}"
        return
    base = request.getfixturevalue("postgres_url")
    schema = f"r_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{base}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_round_trip_scoped_to_its_owner(db_url: str):
    one = ResponseStore.open(db_url, retention_s=3600)
    other_gateway = ResponseStore.open(db_url, retention_s=3600)
    one.save("key:acme", RESPONSE, CONTEXT)
    found = other_gateway.get("resp_abc", "key:acme")
    assert found is not None and found.response == RESPONSE and found.context == CONTEXT
    assert found.history() == [*CONTEXT, *RESPONSE["output"]]
    assert other_gateway.get("resp_abc", "key:other") is None
    assert not other_gateway.delete("resp_abc", "key:other")
    assert other_gateway.delete("resp_abc", "key:acme")
    assert one.get("resp_abc", "key:acme") is None
    one.close()
    other_gateway.close()


def test_retention_hides_then_purges(db_url: str):
    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    store = ResponseStore.open(db_url, retention_s=60)
    store.clock = lambda: now[0]
    store.save("", RESPONSE, CONTEXT)
    store.save("", {**RESPONSE, "id": "resp_later"}, CONTEXT)
    now[0] += timedelta(seconds=30)
    assert store.get("resp_abc", "") is not None
    now[0] += timedelta(seconds=31)
    assert store.get("resp_abc", "") is None
    assert store.purge() == 2 and store.purge() == 0
    forever = ResponseStore(store.sessions, retention_s=0, clock=store.clock)
    forever.save("", {**RESPONSE, "id": "resp_kept"}, CONTEXT)
    now[0] += timedelta(days=3650)
    assert forever.purge() == 0 and forever.get("resp_kept", "") is not None
    store.close()
