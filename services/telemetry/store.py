"""The telemetry history in SQL: requests, spans, fleet and rack samples; retention."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from tokenyard.db.telemetry import FleetSample, RackSample, RequestRecord, SpanRecord
from tokenyard.services.telemetry.spans import SpanRow


def now_utc() -> datetime:
    return datetime.now(UTC)


class TelemetryStore:
    """Synchronous (SQLAlchemy sessions); the service calls it through asyncio.to_thread."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def add_spans(self, spans: Iterable[SpanRow]) -> None:
        at = now_utc()
        with self.sessions.begin() as s:
            s.add_all(
                SpanRecord(
                    trace_id=row.trace_id,
                    span_id=row.span_id,
                    parent_span_id=row.parent_span_id,
                    request_id=row.request_id,
                    service=row.service,
                    name=row.name,
                    start_unix_ns=row.start_unix_ns,
                    end_unix_ns=row.end_unix_ns,
                    status=row.status,
                    attributes=json.dumps(row.attributes),
                    recorded_at=at,
                )
                for row in spans
            )

    def upsert_request(self, request_id: str, **fields: object) -> None:
        with self.sessions.begin() as s:
            record = s.get(RequestRecord, request_id)
            if record is None:
                s.add(RequestRecord(request_id=request_id, **fields))
                return
            for key, value in fields.items():
                if value is not None:
                    setattr(record, key, value)

    def recent_requests(self, limit: int) -> list[RequestRecord]:
        with self.sessions() as s:
            query = select(RequestRecord).order_by(RequestRecord.started_at.desc()).limit(limit)
            return list(s.scalars(query))

    def request(self, request_id: str) -> RequestRecord | None:
        with self.sessions() as s:
            return s.get(RequestRecord, request_id)

    def trace(self, request_id: str) -> list[SpanRecord]:
        """Every span of the request's trace (those of its trace id, else those naming it)."""
        with self.sessions() as s:
            record = s.get(RequestRecord, request_id)
            if record is not None:
                where = SpanRecord.trace_id == record.trace_id
            else:
                where = SpanRecord.request_id == request_id
            return list(
                s.scalars(select(SpanRecord).where(where).order_by(SpanRecord.start_unix_ns))
            )

    def add_fleet_sample(self, sample: FleetSample, racks: list[RackSample]) -> None:
        with self.sessions.begin() as s:
            s.add(sample)
            s.add_all(racks)

    def fleet_history(self, since: datetime) -> list[FleetSample]:
        with self.sessions() as s:
            query = select(FleetSample).where(FleetSample.ts >= since).order_by(FleetSample.ts)
            return list(s.scalars(query))

    def rack_history(self, since: datetime) -> list[RackSample]:
        with self.sessions() as s:
            query = select(RackSample).where(RackSample.ts >= since).order_by(RackSample.ts)
            return list(s.scalars(query))

    def prune(self, retention: timedelta) -> int:
        """Delete rows older than `retention`; returns how many."""
        cutoff = now_utc() - retention
        deleted = 0
        with self.sessions.begin() as s:
            for model, column in (
                (SpanRecord, SpanRecord.recorded_at),
                (RequestRecord, RequestRecord.started_at),
                (FleetSample, FleetSample.ts),
                (RackSample, RackSample.ts),
            ):
                result = s.execute(delete(model).where(column < cutoff))
                deleted += int(result.rowcount or 0)  # type: ignore[attr-defined]
        return deleted
