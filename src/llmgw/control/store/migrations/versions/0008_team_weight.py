"""Teams' weight in their priority class's fair queue (llmgw.gateway.admission).

A server default of 1, so the ALTER runs in place on SQLite and PostgreSQL
alike and old teams weigh what every team weighed before.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("teams", sa.Column("weight", sa.Float, nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("teams") as batch:
        batch.drop_column("weight")
