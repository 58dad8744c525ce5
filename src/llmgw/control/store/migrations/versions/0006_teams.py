"""Teams; keys' team, quotas and budgets; usage's team and spend.

Every new column is nullable or has a server default, so the ALTERs run in
place on SQLite and PostgreSQL alike and old rows read as "no team, no
limit, nothing spent".

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _limits() -> list[sa.Column[object]]:
    return [
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("tokens_per_day", sa.BigInteger, nullable=True),
        sa.Column("tokens_per_month", sa.BigInteger, nullable=True),
        sa.Column("budget_usd", sa.Float, nullable=True),
        sa.Column("budget_period", sa.String(8), nullable=False, server_default="month"),
    ]


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("models", sa.JSON, nullable=False),
        *_limits(),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    for column in _limits()[2:]:
        op.add_column("api_keys", column)
    op.add_column("api_keys", sa.Column("team_id", sa.String(32), nullable=True))
    op.create_index("ix_api_keys_team", "api_keys", ["team_id"])
    op.add_column("usage", sa.Column("team_id", sa.String(32), nullable=True))
    op.add_column("usage", sa.Column("spend_usd", sa.Float, nullable=False, server_default="0"))
    op.create_index("ix_usage_team_minute", "usage", ["team_id", "minute"])


def downgrade() -> None:
    op.drop_index("ix_usage_team_minute", "usage")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("spend_usd")
        batch.drop_column("team_id")
    op.drop_index("ix_api_keys_team", "api_keys")
    with op.batch_alter_table("api_keys") as batch:
        for name in ("team_id", "budget_period", "budget_usd", "tokens_per_month",
                     "tokens_per_day"):
            batch.drop_column(name)
    op.drop_table("teams")
