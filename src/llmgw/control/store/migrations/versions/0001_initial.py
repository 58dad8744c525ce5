"""Initial schema: settings, nodes, gpus, models, replicas, api_keys, usage, events.

Revision ID: 0001
Revises:
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
        "settings",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("admin_state", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(128), nullable=True),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("agent_port", sa.Integer, nullable=True),
        sa.Column("fabrics", sa.JSON, nullable=False),
        sa.Column("inventory", sa.JSON, nullable=True),
        sa.Column("weights", sa.JSON, nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("last_seen", sa.Float, nullable=True),
    )
    op.create_table(
        "gpus",
        sa.Column(
            "node",
            sa.String(200),
            sa.ForeignKey("nodes.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("number", sa.Integer, primary_key=True),
        sa.Column("uuid", sa.String(128), nullable=False),
        sa.Column("gpu_class", sa.String(128), nullable=False),
        sa.Column("healthy", sa.Boolean, nullable=False),
        sa.Column("placeable", sa.Boolean, nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("memory_total_mib", sa.Integer, nullable=False),
    )
    op.create_index("ix_gpus_class", "gpus", ["gpu_class"])
    op.create_table(
        "models",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("parked", sa.Boolean, nullable=False),
        sa.Column("failures", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("demand_at", sa.Float, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("shards", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("port", sa.Integer, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("ready_at", sa.Float, nullable=True),
        sa.Column("last_request_at", sa.Float, nullable=True),
        sa.Column("draining", sa.Boolean, nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
    )
    op.create_index("ix_replicas_model", "replicas", ["model"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("models", sa.JSON, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("revoked", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "usage",
        sa.Column("minute", sa.Integer, primary_key=True),
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("errors", sa.Integer, nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_events_at", "events", ["at"])


def downgrade() -> None:
    for table in ("events", "usage", "api_keys", "replicas", "models", "gpus", "nodes", "settings"):
        op.drop_table(table)
