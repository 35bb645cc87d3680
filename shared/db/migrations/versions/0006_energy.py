"""Telemetry: a request's energy (usage.energy_joules) and the fleet's joules per output token.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 18:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("energy_joules", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("energy_source", sa.String(length=32), nullable=True))
    with op.batch_alter_table("tel_fleet_samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("joules_per_token", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tel_fleet_samples", schema=None) as batch_op:
        batch_op.drop_column("joules_per_token")
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.drop_column("energy_source")
        batch_op.drop_column("energy_joules")
