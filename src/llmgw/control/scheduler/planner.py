"""The planner: the reconciler's next pass as a dry run (``ctl plan``).

It runs the same ``Scheduler.decide`` the reconciler runs, on the same state, and
reports the decisions instead of applying them; that is the whole of the
guarantee that what the plan says is what the reconciler does. "What if"
adds catalog entries to a copy of the model table, never to the state.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, Field

from llmgw.control.adapters import AdapterPlacement, plan_adapters
from llmgw.control.gcpause import paused_gc
from llmgw.control.scheduler.decide import Scheduler
from llmgw.control.scheduler.decisions import Decisions, ModelOutcome, Policy
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.snapshot import PlacementSnapshot, build_snapshot
from llmgw.control.state import FleetState, ModelRecord, ReplicaRecord
from llmgw.wire import Device, ModelSpec, ShardAssignment, device_label_on


class CandidateScore(BaseModel):
    node: str
    gpu_class: str
    score: float
    scores: dict[str, float] = Field(default_factory=dict)


class ReplicaPlan(BaseModel):
    """One replica of a model: kept, placed by this plan, moved or removed."""

    id: str
    action: str  # keep, place, move, drain, remove
    state: str
    nodes: list[str]
    devices: list[str]  # "node:label", e.g. "n1:0", "n1:0/mig1"
    shards: list[ShardAssignment] = Field(default_factory=list)
    fabric: str | None = None
    score: float | None = None
    why: str | None = None


class ModelPlan(BaseModel):
    name: str
    status: str  # satisfied, placing, cannot fit now, can never fit, parked, backing off
    desired: int
    current: int
    on_demand: bool = False
    parked: bool = False
    failures: int = 0
    reason: str | None = None
    # Nodes placement avoids for this model after failures there, e.g. "n3:
    # model m failed there 2 times, last 40 s ago; avoided for 3 min".
    avoided: list[str] = Field(default_factory=list)
    replicas: list[ReplicaPlan] = Field(default_factory=list)
    # The best nodes considered for the first placement, with each scorer's part.
    candidates: list[CandidateScore] = Field(default_factory=list)


class DeviceCount(BaseModel):
    gpu_class: str
    total: int = 0
    used: int = 0
    # free = total - used - unhealthy - out_of_placement, on nodes of any state.
    free: int = 0
    unhealthy: int = 0
    out_of_placement: int = 0
    # Free on ready nodes: what placement can use right now.
    free_ready: int = 0
    # Free after this plan's placements and removals.
    free_after: int = 0


class Plan(BaseModel):
    at: float
    models: list[ModelPlan] = Field(default_factory=list)
    devices: list[DeviceCount] = Field(default_factory=list)
    nodes: dict[str, int] = Field(default_factory=dict)  # by state
    placements: int = 0
    removals: int = 0
    unplaceable: list[str] = Field(default_factory=list)
    what_if: list[str] = Field(default_factory=list)
    # Per base model: its adapters loaded on each replica, and those asked
    # for that could not be loaded, with why (control.adapters).
    adapters: list[AdapterPlacement] = Field(default_factory=list)


def plan(
    state: FleetState,
    now: float,
    *,
    what_if: list[ModelSpec] | None = None,
    policy: Policy | None = None,
    placer: Placer | None = None,
) -> Plan:
    """Where every model's replicas are and would go, and why not.

    ``policy`` should be the reconciler's (``Reconciler.policy``) so that
    backoff and parking read the same; nothing in ``state`` is changed.
    """
    with paused_gc():
        return _plan(state, now, what_if or [], policy, placer)


def _plan(
    state: FleetState,
    now: float,
    what_if: list[ModelSpec],
    policy: Policy | None,
    placer: Placer | None,
) -> Plan:
    view = _with_what_if(state, what_if, now)
    decisions = Scheduler(policy, placer, remember=False).decide(view, now, with_snapshot=True)
    current = build_snapshot(view, now)
    result = Plan(
        at=now,
        what_if=sorted(s.name for s in what_if),
        placements=len(decisions.new),
        removals=len(decisions.removals),
    )
    removed = {r.replica.id: r.kind for r in decisions.removals}
    draining = {r.id for r in decisions.mark_draining}
    for name in sorted(view.models):
        outcome = decisions.outcomes[name]
        model_plan = _model_plan(view.models[name], outcome, view, removed, draining, now)
        result.models.append(model_plan)
        if outcome.unplaceable is not None:
            result.unplaceable.append(name)
    result.devices = _device_counts(current, decisions)
    result.nodes = dict(Counter(str(v.state) for v in current.nodes.values()))
    result.adapters = list(plan_adapters(view, now).bases.values())
    return result


def _with_what_if(state: FleetState, specs: list[ModelSpec], now: float) -> FleetState:
    if not specs:
        return state
    models = dict(state.models)
    for spec in specs:
        old = models.get(spec.name)
        record = ModelRecord(spec=spec, created_at=now, updated_at=now)
        if old is not None:
            record.created_at = old.created_at
            record.parked, record.failures = old.parked, old.failures
            record.last_error, record.demand_at = old.last_error, old.demand_at
            record.backoff_until, record.load_demand = old.backoff_until, old.load_demand
            record.node_failures = old.node_failures
        models[spec.name] = record
    return FleetState(nodes=state.nodes, models=models, replicas=state.replicas)


def _model_plan(
    record: ModelRecord,
    outcome: ModelOutcome,
    state: FleetState,
    removed: dict[str, str],
    draining: set[str],
    now: float,
) -> ModelPlan:
    plan_ = ModelPlan(
        name=record.name,
        status=outcome.status,
        desired=outcome.desired,
        current=len(outcome.kept) + len(outcome.moving),
        on_demand=record.spec.on_demand,
        parked=record.parked,
        failures=record.failures,
        reason=outcome.reason,
        avoided=[
            a.sentence(record.name, now, used=a.node in outcome.used_anyway)
            for a in outcome.avoided
        ],
    )
    moving = {r.id for r in outcome.moving}
    for replica in sorted(state.replicas_of(record.name), key=lambda r: r.id):
        if replica.id in removed:
            action, why = "remove", removed[replica.id]
        elif replica.id in draining:
            action, why = "drain", "replacement ready"
        elif replica.id in moving:
            action, why = "move", "waiting for its replacement"
        else:
            action, why = "keep", None
        plan_.replicas.append(_replica_plan(replica, action, why, state))
    for replica, placement in outcome.placed:
        item = _replica_plan(replica, "place", None, state)
        item.fabric = placement.fabric
        item.score = placement.candidates[0].score if placement.candidates else None
        plan_.replicas.append(item)
    if outcome.placed:
        plan_.candidates = [
            CandidateScore(node=c.node, gpu_class=c.gpu_class, score=c.score, scores=dict(c.scores))
            for c in outcome.placed[0][1].candidates
        ]
    return plan_


def _replica_plan(
    replica: ReplicaRecord, action: str, why: str | None, state: FleetState
) -> ReplicaPlan:
    return ReplicaPlan(
        id=replica.id,
        action=action,
        state=str(replica.state),
        nodes=replica.nodes,
        devices=[
            f"{s.node}:{device_label_on(_inventory_devices(state, s.node), n)}"
            for s in replica.shards
            for n in s.device_numbers
        ],
        shards=list(replica.shards),
        why=why,
    )


def _inventory_devices(state: FleetState, node: str) -> list[Device]:
    record = state.nodes.get(node)
    return record.inventory.devices if record is not None and record.inventory else []


def _device_counts(current: PlacementSnapshot, decisions: Decisions) -> list[DeviceCount]:
    counts: dict[str, DeviceCount] = {}
    for view in current.nodes.values():
        for gpu_class, total in view.total.items():
            row = counts.setdefault(gpu_class, DeviceCount(gpu_class=gpu_class))
            row.total += total
            row.used += view.used.get(gpu_class, 0)
            row.unhealthy += view.unhealthy.get(gpu_class, 0)
            row.out_of_placement += view.out_of_placement.get(gpu_class, 0)
            free = view.free_count(gpu_class)
            row.free += free
            if str(view.state) == "ready":
                row.free_ready += free
    after = decisions.snapshot
    if after is not None:
        for view in after.nodes.values():
            for gpu_class in view.total:
                counts[gpu_class].free_after += view.free_count(gpu_class)
    return [counts[c] for c in sorted(counts)]
