"""Replicas keep their requests in flight, so a standby's views see a busy replica.

Nullable: rows from before this revision have none stored, which reads as
none in flight (rows.replica_from_row).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN (nullable, no default): in place on SQLite and
    # PostgreSQL alike, no table rebuild.
    op.add_column("replicas", sa.Column("in_flight", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("replicas", "in_flight")
