"""Telemetry tables: requests, spans, fleet and rack samples (the console's history).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 02:06:28.736095
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tel_fleet_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("live_workers", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Double(), nullable=False),
        sa.Column("requests_per_s", sa.Double(), nullable=False),
        sa.Column("num_running", sa.Integer(), nullable=False),
        sa.Column("num_waiting", sa.Integer(), nullable=False),
        sa.Column("kv_usage", sa.Double(), nullable=False),
        sa.Column("prefix_hit_rate", sa.Double(), nullable=True),
        sa.Column("ttft_p50_s", sa.Double(), nullable=True),
        sa.Column("ttft_p99_s", sa.Double(), nullable=True),
        sa.Column("itl_p50_s", sa.Double(), nullable=True),
        sa.Column("itl_p99_s", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tel_fleet_samples")),
    )
    with op.batch_alter_table("tel_fleet_samples", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tel_fleet_samples_ts"), ["ts"], unique=False)

    op.create_table(
        "tel_rack_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rack", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("power_kw", sa.Double(), nullable=True),
        sa.Column("supply_c", sa.Double(), nullable=True),
        sa.Column("return_c", sa.Double(), nullable=True),
        sa.Column("flow_lpm", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tel_rack_samples")),
    )
    with op.batch_alter_table("tel_rack_samples", schema=None) as batch_op:
        batch_op.create_index("ix_tel_rack_samples_rack_ts", ["rack", "ts"], unique=False)
        batch_op.create_index(batch_op.f("ix_tel_rack_samples_ts"), ["ts"], unique=False)

    op.create_table(
        "tel_requests",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("operation", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_s", sa.Double(), nullable=True),
        sa.Column("duration_s", sa.Double(), nullable=True),
        sa.Column("prefill_worker", sa.String(length=128), nullable=True),
        sa.Column("decode_worker", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_tel_requests")),
    )
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_tel_requests_started_at"), ["started_at"], unique=False
        )

    op.create_table(
        "tel_spans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=False),
        sa.Column("span_id", sa.String(length=16), nullable=False),
        sa.Column("parent_span_id", sa.String(length=16), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("service", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("start_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attributes", sa.Text(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tel_spans")),
    )
    with op.batch_alter_table("tel_spans", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tel_spans_recorded_at"), ["recorded_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_tel_spans_request_id"), ["request_id"], unique=False)
        batch_op.create_index("ix_tel_spans_trace", ["trace_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tel_spans", schema=None) as batch_op:
        batch_op.drop_index("ix_tel_spans_trace")
        batch_op.drop_index(batch_op.f("ix_tel_spans_request_id"))
        batch_op.drop_index(batch_op.f("ix_tel_spans_recorded_at"))

    op.drop_table("tel_spans")
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tel_requests_started_at"))

    op.drop_table("tel_requests")
    with op.batch_alter_table("tel_rack_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tel_rack_samples_ts"))
        batch_op.drop_index("ix_tel_rack_samples_rack_ts")

    op.drop_table("tel_rack_samples")
    with op.batch_alter_table("tel_fleet_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tel_fleet_samples_ts"))

    op.drop_table("tel_fleet_samples")
