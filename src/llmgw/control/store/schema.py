"""The store's tables (SQLAlchemy Core).

Core rather than the ORM: the control plane keeps its working state in memory
and writes rows in batches, so an identity map would only cost time. Nested
values (inventories, catalog entries, shards) are JSON: they are read and
written whole, never queried by their parts.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

# Small values that must survive restarts: credential hashes, the leader epoch.
settings = Table(
    "settings",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(200), primary_key=True),
    # What an operator set: ready, cordoned or draining. "unreachable" is
    # derived from last_seen and never stored, so a node that comes back is
    # not stuck in it.
    Column("admin_state", String(16), nullable=False, default="ready"),
    Column("token_hash", String(128), nullable=True),
    # The hash of the key the node's agent made for its data dir: the same
    # data dir may register the node again (a lost answer), another may not.
    # None for nodes registered before agent keys (migration 0002).
    Column("agent_key_hash", String(128), nullable=True),
    Column("address", String(255), nullable=False, default="127.0.0.1"),
    Column("agent_port", Integer, nullable=True),
    Column("fabrics", JSON, nullable=False, default=list),
    Column("inventory", JSON, nullable=True),
    Column("weights", JSON, nullable=False, default=list),
    Column("registered_at", Float, nullable=False),
    Column("last_seen", Float, nullable=True),
)

# Which node a (normalised, not loopback) address belongs to, for the
# certificate that names it (llmgw.control.nodecerts): the first node given
# one keeps it until an admin frees it or deletes the node.
address_claims = Table(
    "address_claims",
    metadata,
    Column("address", String(255), primary_key=True),
    Column("node", String(200), nullable=False),
    Column("claimed_at", Float, nullable=False),
)

# One row per placeable device, rewritten when a node's inventory changes;
# kept as its own table so that SQL can answer "which nodes have free
# h100-80g" without unpacking every inventory.
gpus = Table(
    "gpus",
    metadata,
    Column("node", String(200), ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True),
    Column("number", Integer, primary_key=True),
    Column("uuid", String(128), nullable=False),
    Column("gpu_class", String(128), nullable=False),
    Column("healthy", Boolean, nullable=False),
    Column("placeable", Boolean, nullable=False),
    Column("reason", Text, nullable=True),
    Column("memory_total_mib", Integer, nullable=False, default=0),
)
Index("ix_gpus_class", gpus.c.gpu_class)

models = Table(
    "models",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("parked", Boolean, nullable=False, default=False),
    Column("failures", Integer, nullable=False, default=0),
    Column("last_error", Text, nullable=True),
    # {node: {"failures", "last_at", "current_run"}}: the model's failed
    # starts by node (state.NodeFailure). NULL on rows from before 0003.
    Column("node_failures", JSON, nullable=True),
    Column("demand_at", Float, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

replicas = Table(
    "replicas",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("model", String(200), nullable=False),
    Column("generation", Integer, nullable=False, default=1),
    Column("shards", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("port", Integer, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("ready_at", Float, nullable=True),
    Column("last_request_at", Float, nullable=True),
    # Requests in flight as the leader last stored them (control.inflight.
    # StoredActivity), for standbys' views; null in rows from before 0004.
    Column("in_flight", Integer, nullable=True),
    Column("draining", Boolean, nullable=False, default=False),
    # The leader epoch that last wrote the row, for post-mortems of failovers.
    Column("epoch", Integer, nullable=False, default=0),
)
Index("ix_replicas_model", replicas.c.model)


def _limit_columns() -> list[Column[object]]:
    """The limits keys and teams both carry (wire.TenantLimits); null: none."""
    return [
        Column("rpm", Integer, nullable=True),
        Column("tpm", Integer, nullable=True),
        Column("tokens_per_day", BigInteger, nullable=True),
        Column("tokens_per_month", BigInteger, nullable=True),
        Column("budget_usd", Float, nullable=True),
        Column("budget_period", String(8), nullable=False, default="month"),
        # The class in a saturated model's hold queue; null: the team's, or standard.
        Column("priority", String(16), nullable=True),
    ]


# Tenants: a key with a team is under the team's models and limits as well
# as its own; deleting a team that still has live keys is refused.
teams = Table(
    "teams",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("models", JSON, nullable=False, default=list),
    *_limit_columns(),
    Column("created_at", Float, nullable=False),
    # Its weight in its priority class's fair queue (wire.TeamInfo.weight).
    Column("weight", Float, nullable=False, default=1.0),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False, default=""),
    Column("secret_hash", String(128), nullable=False, unique=True),
    Column("models", JSON, nullable=False, default=list),
    Column("expires_at", Float, nullable=True),
    *_limit_columns(),
    Column("revoked", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("team_id", String(32), nullable=True),
)
Index("ix_api_keys_team", api_keys.c.team_id)

usage = Table(
    "usage",
    metadata,
    Column("minute", Integer, primary_key=True),
    Column("key_id", String(32), primary_key=True),
    Column("model", String(200), primary_key=True),
    Column("requests", Integer, nullable=False, default=0),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("cached_tokens", Integer, nullable=False, default=0),
    Column("errors", Integer, nullable=False, default=0),
    # The key's team when the row was written (None: the operator's), so a
    # team's usage stays its own after a key moves; and what the tokens cost
    # at the catalog's prices then (US dollars).
    Column("team_id", String(32), nullable=True),
    Column("spend_usd", Float, nullable=False, default=0.0),
)
Index("ix_usage_team_minute", usage.c.team_id, usage.c.minute)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("subject", String(200), nullable=False, default=""),
    Column("message", Text, nullable=False),
    Column("data", JSON, nullable=False, default=dict),
)
Index("ix_events_at", events.c.at)
