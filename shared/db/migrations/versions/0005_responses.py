"""Gateway: stored responses of the Responses API (previous_response_id, GET, DELETE).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 14:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gw_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("context", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gw_responses")),
    )
    with op.batch_alter_table("gw_responses", schema=None) as batch_op:
        batch_op.create_index("ix_gw_responses_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("gw_responses", schema=None) as batch_op:
        batch_op.drop_index("ix_gw_responses_expires_at")
    op.drop_table("gw_responses")
