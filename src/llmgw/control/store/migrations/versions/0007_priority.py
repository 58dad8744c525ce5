"""Keys' and teams' priority class in the gateways' hold queue (llmgw.gateway.admission).

Nullable, so the ALTERs run in place on SQLite and PostgreSQL alike and old
rows read as "no class of their own" (a key: its team's; else standard).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("api_keys", "teams"):
        op.add_column(table, sa.Column("priority", sa.String(16), nullable=True))


def downgrade() -> None:
    for table in ("api_keys", "teams"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("priority")
