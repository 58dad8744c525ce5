"""Records <-> store rows: the one place that knows both shapes.

The control plane keeps records in memory (llmgw.control.state) and the store
keeps rows (llmgw.control.store.schema); every write and every load goes
through these functions, so a column added in one place cannot be forgotten
in another.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.control import telemetry
from llmgw.control.state import ModelRecord, NodeFailure, NodeRecord, ReplicaRecord
from llmgw.control.store.repo import Row
from llmgw.wire import (
    ApiKeyInfo,
    Event,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaState,
    ShardAssignment,
    TeamInfo,
    TenantLimits,
    WeightsEntry,
)


def node_row(node: NodeRecord) -> Row:
    return {
        "name": node.name,
        "admin_state": node.admin_state.value,
        "token_hash": node.token_hash,
        "agent_key_hash": node.agent_key_hash,
        "address": node.address,
        "agent_port": node.agent_port,
        "fabrics": list(node.fabrics),
        "inventory": _inventory_json(node),
        "weights": [w.model_dump(mode="json") for w in node.weights],
        "registered_at": node.registered_at,
        "last_seen": node.last_seen,
    }


def _inventory_json(node: NodeRecord) -> dict[str, object] | None:
    """The node's inventory with its latest readings (control.telemetry), as stored."""
    if node.inventory is None:
        return None
    out = node.inventory.model_dump(mode="json")
    readings = telemetry.current(node.inventory, node.readings)
    if readings is not None:
        for index, device in enumerate(out["devices"]):
            device.update(zip(telemetry.TELEMETRY_FIELDS, readings.of(index), strict=True))
    return out


def node_from_row(row: Row) -> NodeRecord:
    return NodeRecord(
        name=row["name"],
        registered_at=row["registered_at"],
        admin_state=NodeState(row["admin_state"]),
        token_hash=row["token_hash"],
        agent_key_hash=row["agent_key_hash"],
        address=row["address"],
        agent_port=row["agent_port"],
        fabrics=list(row["fabrics"] or []),
        inventory=NodeInventory.model_validate(row["inventory"]) if row["inventory"] else None,
        weights=[WeightsEntry.model_validate(w) for w in row["weights"] or []],
        last_seen=row["last_seen"],
    )


def gpu_rows(inventory: NodeInventory) -> list[Row]:
    return [
        {
            "number": d.number,
            "uuid": d.uuid,
            "gpu_class": d.gpu_class,
            "healthy": d.healthy,
            "placeable": d.placeable,
            "reason": "; ".join(d.unhealthy_reasons) or d.unplaceable_reason,
            "memory_total_mib": d.memory_total_mib,
        }
        for d in inventory.devices
    ]


def model_row(model: ModelRecord, *, updated_at: float | None = None) -> Row:
    return {
        "name": model.name,
        "spec": model.spec.model_dump(mode="json"),
        "parked": model.parked,
        "failures": model.failures,
        "last_error": model.last_error,
        "node_failures": node_failures_json(model.node_failures),
        "demand_at": model.demand_at,
        "created_at": model.created_at,
        "updated_at": model.updated_at if updated_at is None else updated_at,
    }


def node_failures_json(failures: Mapping[str, NodeFailure]) -> dict[str, Row]:
    return {
        node: {"failures": f.failures, "last_at": f.last_at, "current_run": f.current_run}
        for node, f in sorted(failures.items())
    }


def model_from_row(row: Row) -> ModelRecord:
    return ModelRecord(
        spec=ModelSpec.model_validate(row["spec"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        parked=bool(row["parked"]),
        failures=row["failures"],
        last_error=row["last_error"],
        node_failures={
            node: NodeFailure(int(f["failures"]), float(f["last_at"]), bool(f["current_run"]))
            for node, f in (row["node_failures"] or {}).items()
        },
        demand_at=row["demand_at"],
    )


def replica_row(replica: ReplicaRecord, *, draining: bool = False) -> Row:
    """The replica's row; ``draining`` writes it as draining before memory follows
    (the reconciler's write-then-apply). The draining column repeats the state
    for rows read by older versions."""
    state = ReplicaState.DRAINING if draining else replica.state
    return {
        "id": replica.id,
        "model": replica.model,
        "generation": replica.generation,
        # Python mode: a shard is strings and numbers only, and the JSON
        # mode's walk took twice as long (10,000 replicas in one pass).
        "shards": [s.model_dump() for s in replica.shards],
        "state": state.value,
        "reason": replica.reason,
        "port": replica.port,
        "created_at": replica.created_at,
        "ready_at": replica.ready_at,
        "last_request_at": replica.last_request_at,
        "in_flight": replica.in_flight,
        "draining": state is ReplicaState.DRAINING,
    }


def replica_from_row(row: Row) -> ReplicaRecord:
    state = ReplicaState(row["state"])
    if row["draining"] and state is not ReplicaState.FAILED:
        # Written before draining was a state: ready (or starting) plus the flag.
        state = ReplicaState.DRAINING
    return ReplicaRecord(
        id=row["id"],
        model=row["model"],
        created_at=row["created_at"],
        shards=[ShardAssignment.model_validate(s) for s in row["shards"]],
        generation=row["generation"],
        state=state,
        reason=row["reason"],
        port=row["port"],
        ready_at=row["ready_at"],
        last_request_at=row["last_request_at"],
        in_flight=row.get("in_flight") or 0,
    )


LIMIT_FIELDS = ("rpm", "tpm", "tokens_per_day", "tokens_per_month", "budget_usd",
                "budget_period", "priority")


def limits_row(limits: TenantLimits) -> Row:
    return {name: getattr(limits, name) for name in LIMIT_FIELDS}


def _limits_of(row: Row) -> Row:
    out = {name: row.get(name) for name in LIMIT_FIELDS}
    out["budget_period"] = out["budget_period"] or "month"
    return out


def key_from_row(row: Row) -> ApiKeyInfo:
    return ApiKeyInfo(
        key_id=row["id"],
        name=row["name"],
        secret_hash=row["secret_hash"],
        models=list(row["models"] or []),
        expires_at=row["expires_at"],
        revoked=bool(row["revoked"]),
        team_id=row.get("team_id"),
        **_limits_of(row),
    )


def team_row(team: TeamInfo, created_at: float) -> Row:
    return {"id": team.team_id, "name": team.name, "models": list(team.models),
            **limits_row(team), "weight": team.weight, "created_at": created_at}


def team_from_row(row: Row) -> TeamInfo:
    return TeamInfo(team_id=row["id"], name=row["name"], models=list(row["models"] or []),
                    weight=row.get("weight") or 1.0, **_limits_of(row))


def event_row(event: Event) -> Row:
    return {
        "at": event.at,
        "kind": event.kind,
        "subject": event.subject,
        "message": event.message,
        "data": dict(event.data),
    }
