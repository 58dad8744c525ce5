"""Alembic environment: llmgw runs migrations itself, at start.

The connection comes from ``config.attributes["connection"]`` (see
llmgw.control.store.migrate); there is no alembic.ini to keep in sync.
"""

from __future__ import annotations

from alembic import context

from llmgw.control.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds tables.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        # Two control planes starting together would both run CREATE TABLE;
        # the second waits here and then finds the schema at head.
        connection.exec_driver_sql("SELECT pg_advisory_xact_lock(73110001)")
    context.run_migrations()
