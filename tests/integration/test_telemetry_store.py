"""The telemetry history on SQLite and PostgreSQL: requests upserted from their spans, a
trace by request id, samples, and retention."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from tokenyard.db import make_engine, make_sessionmaker, migrate
from tokenyard.db.telemetry import FleetSample, RackSample, SpanRecord
from tokenyard.services.telemetry.spans import SpanRow
from tokenyard.services.telemetry.store import TelemetryStore, now_utc


@pytest.fixture
def store(db_url: str) -> Iterator[TelemetryStore]:
    migrate(db_url)
    engine = make_engine(db_url)
    yield TelemetryStore(make_sessionmaker(engine))
    engine.dispose()


def span(name: str, span_id: str, parent: str | None, rid: str | None, start: int) -> SpanRow:
    attributes = {"tokenyard.request_id": rid} if rid else {}
    return SpanRow(
        "ab" * 16, span_id, parent, "svc", name, start, start + 1000, "unset", attributes
    )


def test_requests_traces_samples_and_retention(store: TelemetryStore) -> None:
    store.add_spans(
        [
            span("chat m", "01" * 8, None, "r1", 10),
            span("router.route", "02" * 8, "01" * 8, "r1", 20),
            span("engine", "03" * 8, "02" * 8, None, 30),  # no request id: found by trace id
        ]
    )
    store.upsert_request(
        "r1", trace_id="ab" * 16, started_at=now_utc(), operation="chat", model="m", status="ok"
    )
    store.upsert_request("r1", prefill_worker="p1", decode_worker=None)
    (record,) = store.recent_requests(10)
    assert (record.request_id, record.prefill_worker, record.model) == ("r1", "p1", "m")
    assert [s.name for s in store.trace("r1")] == ["chat m", "router.route", "engine"]
    assert store.trace("nope") == []

    sample = FleetSample(
        ts=now_utc(), live_workers=2, tokens_per_s=5.0, requests_per_s=1.0, num_running=1,
        num_waiting=0, kv_usage=0.5, prefix_hit_rate=None, ttft_p50_s=0.1, ttft_p99_s=0.2,
        itl_p50_s=None, itl_p99_s=None,
    )  # fmt: skip
    store.add_fleet_sample(
        sample, [RackSample(ts=now_utc(), rack="a", state="normal", power_kw=2.0)]
    )
    since = now_utc() - timedelta(minutes=1)
    assert len(store.fleet_history(since)) == 1 and store.rack_history(since)[0].rack == "a"

    assert store.prune(timedelta(hours=1)) == 0
    with store.sessions.begin() as s:  # age the spans past the retention
        s.execute(update(SpanRecord).values(recorded_at=now_utc() - timedelta(hours=2)))
    assert store.prune(timedelta(hours=1)) == 3
    assert [s.name for s in store.trace("r1")] == []
    assert store.request("r1") is not None  # its own age is what counts
