"""Models remember their failed starts by node (a broken node must not park them).

Nullable JSON: rows from before this revision have no failures by node,
which reads as none (rows.model_from_row).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN (nullable, no default): in place on SQLite and
    # PostgreSQL alike, no table rebuild.
    op.add_column("models", sa.Column("node_failures", sa.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("models", "node_failures")
