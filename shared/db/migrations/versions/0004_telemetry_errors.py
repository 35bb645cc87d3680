"""Telemetry: a failed request's error code and message (the console's request rows).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 04:50:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("error_code", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("error_message", sa.String(length=1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tel_requests", schema=None) as batch_op:
        batch_op.drop_column("error_message")
        batch_op.drop_column("error_code")
