"""Telemetry tables: requests (from their root spans), spans, and sampled fleet and rack
history for the console's charts. Every row has a time, and retention deletes old ones.

Request 1-* Span (by request_id; a span's trace_id ties it to its trace)
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from tokenyard.db.base import Base, UTCDateTime


class RequestRecord(Base):
    """One served request, as its gateway span and router span describe it."""

    __tablename__ = "tel_requests"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    trace_id: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    operation: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))  # ok | error
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None]
    output_tokens: Mapped[int | None]
    cached_tokens: Mapped[int | None]
    ttft_s: Mapped[float | None]
    duration_s: Mapped[float | None]
    prefill_worker: Mapped[str | None] = mapped_column(String(128))
    decode_worker: Mapped[str | None] = mapped_column(String(128))
    error_code: Mapped[str | None] = mapped_column(String(64))  # a failed request's
    error_message: Mapped[str | None] = mapped_column(String(1024))
    energy_joules: Mapped[float | None]  # usage.energy_joules
    energy_source: Mapped[str | None] = mapped_column(String(32))  # modelled | measured:<counter>


class SpanRecord(Base):
    __tablename__ = "tel_spans"
    __table_args__ = (Index("ix_tel_spans_trace", "trace_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[str] = mapped_column(String(32))
    span_id: Mapped[str] = mapped_column(String(16))
    parent_span_id: Mapped[str | None] = mapped_column(String(16))
    request_id: Mapped[str | None] = mapped_column(String(128), index=True)
    service: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(256))
    start_unix_ns: Mapped[int] = mapped_column(BigInteger)
    end_unix_ns: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))  # unset | ok | error
    attributes: Mapped[str] = mapped_column(Text)  # JSON object
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class FleetSample(Base):
    """The fleet's figures at one moment (the console's live charts, with history)."""

    __tablename__ = "tel_fleet_samples"

    id: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    live_workers: Mapped[int]
    tokens_per_s: Mapped[float]
    requests_per_s: Mapped[float]
    num_running: Mapped[int]
    num_waiting: Mapped[int]
    kv_usage: Mapped[float]
    prefix_hit_rate: Mapped[float | None]
    ttft_p50_s: Mapped[float | None]
    ttft_p99_s: Mapped[float | None]
    itl_p50_s: Mapped[float | None]
    itl_p99_s: Mapped[float | None]
    joules_per_token: Mapped[float | None]  # per output token, of the window's requests


class RackSample(Base):
    __tablename__ = "tel_rack_samples"
    __table_args__ = (Index("ix_tel_rack_samples_rack_ts", "rack", "ts"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    rack: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))
    power_kw: Mapped[float | None]
    supply_c: Mapped[float | None]
    return_c: Mapped[float | None]
    flow_lpm: Mapped[float | None]
