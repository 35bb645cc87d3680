"""Facilities tables: sites, coolant loops, racks, nodes, workers, readings, state events.

Revision ID: 0001
Revises:
Create Date: 2026-12-02 12:43:17.468258
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fac_sites",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_sites")),
        sa.UniqueConstraint("name", name=op.f("uq_fac_sites_name")),
    )
    op.create_table(
        "fac_coolant_loops",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("supply_limit_c", sa.Double(), nullable=False),
        sa.Column("return_limit_c", sa.Double(), nullable=False),
        sa.Column("min_flow_lpm", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["site_id"],
            ["fac_sites.id"],
            name=op.f("fk_fac_coolant_loops_site_id_fac_sites"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_coolant_loops")),
        sa.UniqueConstraint("name", name=op.f("uq_fac_coolant_loops_name")),
    )
    op.create_table(
        "fac_racks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("loop_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("power_cap_kw", sa.Double(), nullable=False),
        sa.Column("cooling_type", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["fac_coolant_loops.id"],
            name=op.f("fk_fac_racks_loop_id_fac_coolant_loops"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["site_id"],
            ["fac_sites.id"],
            name=op.f("fk_fac_racks_site_id_fac_sites"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_racks")),
        sa.UniqueConstraint("name", name=op.f("uq_fac_racks_name")),
    )
    op.create_table(
        "fac_nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rack_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("gpu_tdp_w", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rack_id"],
            ["fac_racks.id"],
            name=op.f("fk_fac_nodes_rack_id_fac_racks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_fac_nodes_name")),
    )
    op.create_table(
        "fac_readings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rack_id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("power_kw", sa.Double(), nullable=False),
        sa.Column("supply_c", sa.Double(), nullable=True),
        sa.Column("return_c", sa.Double(), nullable=True),
        sa.Column("flow_lpm", sa.Double(), nullable=True),
        sa.Column("inlet_air_c", sa.Double(), nullable=True),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["rack_id"],
            ["fac_racks.id"],
            name=op.f("fk_fac_readings_rack_id_fac_racks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_readings")),
    )
    with op.batch_alter_table("fac_readings", schema=None) as batch_op:
        batch_op.create_index("ix_fac_readings_rack_ts", ["rack_id", "ts"], unique=False)

    op.create_table(
        "fac_state_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rack_id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=False),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("max_seqs_per_worker", sa.Integer(), nullable=False),
        sa.Column("reading_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rack_id"],
            ["fac_racks.id"],
            name=op.f("fk_fac_state_events_rack_id_fac_racks"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["reading_id"],
            ["fac_readings.id"],
            name=op.f("fk_fac_state_events_reading_id_fac_readings"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fac_state_events")),
    )
    with op.batch_alter_table("fac_state_events", schema=None) as batch_op:
        batch_op.create_index("ix_fac_state_events_rack_ts", ["rack_id", "ts"], unique=False)

    op.create_table(
        "fac_workers",
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["fac_nodes.id"],
            name=op.f("fk_fac_workers_node_id_fac_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("worker_id", name=op.f("pk_fac_workers")),
    )


def downgrade() -> None:
    op.drop_table("fac_workers")
    with op.batch_alter_table("fac_state_events", schema=None) as batch_op:
        batch_op.drop_index("ix_fac_state_events_rack_ts")

    op.drop_table("fac_state_events")
    with op.batch_alter_table("fac_readings", schema=None) as batch_op:
        batch_op.drop_index("ix_fac_readings_rack_ts")

    op.drop_table("fac_readings")
    op.drop_table("fac_nodes")
    op.drop_table("fac_racks")
    op.drop_table("fac_coolant_loops")
    op.drop_table("fac_sites")
