"""Node addresses bound to one node each, for its server certificate.

A node's certificate names its address; the first node to be given one for
an address keeps it until an admin frees it (``llmgw ctl nodes free-address``)
or deletes that node, so a rogue node cannot take a peer's address by
reporting it first or after the peer went quiet.

Revision ID: 0005
Revises: 0004
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
        "address_claims",
        sa.Column("address", sa.String(255), primary_key=True),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("claimed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("address_claims")
