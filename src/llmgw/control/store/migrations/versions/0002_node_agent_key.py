"""Nodes remember the hash of their agent's key, so a lost registration answer can be retried.

Nullable: nodes registered before agent keys existed have none, and keep
today's rule (registering their name again needs the node deleted first).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN on both back ends, not a batch rebuild: SQLite adds a
    # nullable column in place, and rebuilding ``nodes`` means dropping a table
    # that ``gpus`` references with ON DELETE CASCADE.
    op.add_column("nodes", sa.Column("agent_key_hash", sa.String(128), nullable=True))


def downgrade() -> None:
    # In place too: SQLite has had DROP COLUMN since 3.35 (2021).
    op.drop_column("nodes", "agent_key_hash")
