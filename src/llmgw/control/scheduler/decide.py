"""One reconcile pass as a pure function: state in, decisions out.

``decide`` reads FleetState and returns what should change (replicas to
create, remove or mark draining, model failure counts, events) without
changing anything. The reconciler writes the decisions to the store and only
then applies them to memory, so a write refused by the store (a deposed
leader) leaves memory as it was; the planner runs the very same function and
shows the decisions instead, which is why the two cannot disagree.

Order inside a pass: first every removal (failed, lost, extra, drained), so
their devices are free for this pass's placements; then placements, always-on
models before on-demand ones and larger shapes before smaller ones
(best-fit decreasing leaves less stranded capacity than arrival order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from llmgw.control.scheduler.explain import CAN_NEVER_FIT, CANNOT_FIT_NOW
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placement import Placement, Placer, Unplaceable, commit
from llmgw.control.scheduler.snapshot import DeviceCache, Snapshot, build_snapshot
from llmgw.control.state import REPLACE_AFTER_S, FleetState, ModelRecord, ReplicaRecord
from llmgw.secrets import new_id
from llmgw.wire import Event, ModelSpec, NodeState, ReplicaState

SATISFIED = "satisfied"
PLACING = "placing"
PARKED = "parked"
BACKING_OFF = "backing off"


@dataclass(frozen=True, slots=True)
class Policy:
    """The reconciler's knobs; the planner takes the same object."""

    failure_limit: int = 5
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    replace_after_s: float = REPLACE_AFTER_S
    # A replica marked draining is removed once no request is in flight and
    # gateways have had this long to see the new routing table ...
    drain_grace_s: float = 5.0
    # ... or after this long in any case (a gateway that went away keeps
    # reporting nothing, and its stale in-flight count must not pin a node).
    drain_timeout_s: float = 120.0
    # An on-demand replica is evicted for another model only after this long
    # unasked-for: two models taking turns on one card every pass would
    # reload weights forever and serve nothing.
    evict_min_idle_s: float = 60.0

    def backoff(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_base_s * 2 ** (failures - 1)))


@dataclass(slots=True)
class ModelUpdate:
    """New values of a model's failure bookkeeping (persisted)."""

    name: str
    failures: int
    parked: bool
    last_error: str | None
    backoff_until: float


@dataclass(slots=True)
class Removal:
    replica: ReplicaRecord
    kind: str  # failed, replaced, scaled-down, unloaded, evicted, drained, orphaned


@dataclass(slots=True)
class ModelOutcome:
    """What the pass did or would do for one model (the planner shows it)."""

    name: str
    desired: int
    kept: list[ReplicaRecord] = field(default_factory=list)
    moving: list[ReplicaRecord] = field(default_factory=list)
    placed: list[tuple[ReplicaRecord, Placement]] = field(default_factory=list)
    status: str = SATISFIED
    reason: str | None = None
    unplaceable: Unplaceable | None = None


@dataclass(slots=True)
class Decisions:
    now: float
    new: list[ReplicaRecord] = field(default_factory=list)
    removals: list[Removal] = field(default_factory=list)
    mark_draining: list[ReplicaRecord] = field(default_factory=list)
    models: dict[str, ModelUpdate] = field(default_factory=dict)
    # model -> unplaceable reason (None: placeable); memory only.
    reasons: dict[str, str | None] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    outcomes: dict[str, ModelOutcome] = field(default_factory=dict)
    # replica id -> when it was first seen draining (memory of the reconciler).
    draining_since: dict[str, float] = field(default_factory=dict)
    snapshot: Snapshot | None = None

    @property
    def changes_replicas(self) -> bool:
        return bool(self.new or self.removals or self.mark_draining)

    def event(
        self, kind: str, subject: str, message: str, **data: str | int | float | None
    ) -> None:
        self.events.append(
            Event(at=self.now, kind=kind, subject=subject, message=message, data=data)
        )


@dataclass(slots=True)
class _Work:
    """A model's pending placement work, between the two phases."""

    record: ModelRecord
    outcome: ModelOutcome
    to_place: int
    moving_ids: list[str]


def decide(
    state: FleetState,
    now: float,
    policy: Policy | None = None,
    *,
    placer: Placer | None = None,
    draining_since: Mapping[str, float] | None = None,
    always_snapshot: bool = False,
    cache: DeviceCache | None = None,
) -> Decisions:
    policy = policy or Policy()
    placer = placer or Placer()
    cache = cache if cache is not None else DeviceCache()
    out = Decisions(now=now)
    known_draining = dict(draining_since or {})

    lost_nodes = {
        name
        for name, node in state.nodes.items()
        if now - (node.last_seen if node.last_seen is not None else node.registered_at)
        > policy.replace_after_s
    }
    draining_nodes = {
        name for name, node in state.nodes.items() if node.admin_state is NodeState.DRAINING
    }
    by_model: dict[str, list[ReplicaRecord]] = {}
    for replica in state.replicas.values():
        by_model.setdefault(replica.model, []).append(replica)

    # Replicas of models no longer in the catalog.
    for model in sorted(set(by_model) - set(state.models)):
        for replica in sorted(by_model[model], key=lambda r: r.id):
            out.removals.append(Removal(replica, "orphaned"))
            out.event(
                "removed", replica.id, f"removed replica {replica.id}: model {model!r} was deleted"
            )

    work: list[_Work] = []
    shapes = _ShapeCheck(state, cache)
    for name in sorted(state.models):
        record = state.models[name]
        replicas = sorted(by_model.get(name, []), key=lambda r: r.id)
        item = _phase_one(
            out, record, replicas, now, policy, lost_nodes, draining_nodes, shapes, known_draining
        )
        work.append(item)

    pending = [w for w in work if w.to_place > 0]
    if pending or always_snapshot:
        removed = [r.replica.id for r in out.removals]
        out.snapshot = build_snapshot(state, now, exclude=removed, cache=cache)
    if pending and out.snapshot is not None:
        evictable = _evictable(state, out, now, policy)
        pending.sort(key=lambda w: (w.record.spec.on_demand, -w.record.spec.gpus, w.record.name))
        failed_shapes: set[Request] = set()
        for item in pending:
            _place_model(out, out.snapshot, placer, item, evictable, failed_shapes)
    for item in work:
        record = item.record
        reason = item.outcome.reason if item.outcome.unplaceable is not None else None
        out.reasons[record.name] = reason
        if reason is not None and reason != record.unplaceable_reason:
            out.event("unplaceable", record.name, f"{record.name}: {item.outcome.status}: {reason}")
    return out


# ---------------------------------------------------------------------------
# Phase one: sort each model's replicas, count failures, decide removals
# ---------------------------------------------------------------------------


def _phase_one(
    out: Decisions,
    record: ModelRecord,
    replicas: list[ReplicaRecord],
    now: float,
    policy: Policy,
    lost_nodes: set[str],
    draining_nodes: set[str],
    shapes: _ShapeCheck,
    known_draining: dict[str, float],
) -> _Work:
    spec = record.spec
    failures, parked = record.failures, record.parked
    last_error, backoff_until = record.last_error, record.backoff_until

    # A start that succeeded after the last failure breaks the run of
    # consecutive failures; a replica that was ready all along does not (a
    # model whose every new start fails must still be parked).
    last_failure = backoff_until - policy.backoff(failures)
    if failures and any(
        r.state is ReplicaState.READY and r.created_at >= last_failure for r in replicas
    ):
        failures, backoff_until = 0, 0.0

    live: list[ReplicaRecord] = []
    moving: list[ReplicaRecord] = []
    for replica in replicas:
        failed_reason = _failure(replica, spec, now)
        if failed_reason is not None:
            out.removals.append(Removal(replica, "failed"))
            failures += 1
            last_error = failed_reason
            backoff_until = now + policy.backoff(failures)
            out.event(
                "failed",
                spec.name,
                f"replica {replica.id} of {spec.name} failed on {', '.join(replica.nodes)}:"
                f" {failed_reason} (failure {failures} of {policy.failure_limit})",
                replica=replica.id,
                failures=failures,
            )
            continue
        gone = [n for n in replica.nodes if n in lost_nodes or n not in shapes.state.nodes]
        if gone:
            out.removals.append(Removal(replica, "replaced"))
            out.event(
                "replaced",
                spec.name,
                f"replica {replica.id} of {spec.name} lost with node {gone[0]}"
                f" (no report for more than {policy.replace_after_s:g} s); placing it elsewhere",
                replica=replica.id,
                node=gone[0],
            )
            continue
        if replica.draining:
            _finish_drain(out, replica, now, policy, known_draining)
            continue
        if any(n in draining_nodes for n in replica.nodes) or not shapes.fits(replica, spec):
            moving.append(replica)
        else:
            live.append(replica)

    if failures >= policy.failure_limit and not parked:
        parked = True
        out.event(
            "parked",
            spec.name,
            f"{spec.name} parked after {failures} consecutive failed starts;"
            f" last error: {last_error}",
            failures=failures,
            last_error=last_error,
        )
    if (failures, parked, last_error, backoff_until) != (
        record.failures,
        record.parked,
        record.last_error,
        record.backoff_until,
    ):
        out.models[spec.name] = ModelUpdate(spec.name, failures, parked, last_error, backoff_until)

    desired = _desired(record, live + moving, now)
    outcome = ModelOutcome(spec.name, desired)
    out.outcomes[spec.name] = outcome

    # Extras go idle-first: the replica nobody is using costs nothing to stop.
    if len(live) > desired:
        order = sorted(live, key=lambda r: _retire_order(r, now))
        for replica in order[: len(live) - desired]:
            idle = _idle(replica, now)
            kind = (
                "unloaded"
                if spec.on_demand and desired == 0 and idle >= spec.idle_timeout_s
                else "scaled-down"
            )
            _retire(out, replica, kind, f"idle for {idle:.0f} s", now)
        keep = {r.id for r in order[len(live) - desired :]}
        live = [r for r in live if r.id in keep]

    # Make-before-break: a replica leaving a draining node (or one whose
    # entry changed shape) is marked draining only once a ready replica
    # elsewhere has taken its seat.
    ready_live = sum(1 for r in live if r.state is ReplicaState.READY)
    can_retire = max(0, min(len(moving), ready_live + len(moving) - desired))
    for replica in sorted(moving, key=lambda r: _retire_order(r, now))[:can_retire]:
        _retire(out, replica, "drained", "its replacement is ready", now, always_drain=True)
    outcome.kept = live
    outcome.moving = moving

    to_place = max(0, desired - len(live))
    if to_place and parked:
        outcome.status = PARKED
        outcome.reason = f"parked after {failures} failed starts; last error: {last_error}"
        to_place = 0
    elif to_place and backoff_until > now:
        outcome.status = BACKING_OFF
        outcome.reason = (
            f"retrying after {failures} failed start{'s' if failures != 1 else ''}"
            f" in {backoff_until - now:.0f} s; last error: {last_error}"
        )
        to_place = 0
    return _Work(record, outcome, to_place, [r.id for r in moving])


def _failure(replica: ReplicaRecord, spec: ModelSpec, now: float) -> str | None:
    # A replica that was being stopped anyway is not a failed start.
    if replica.draining:
        return None
    if replica.state is ReplicaState.FAILED:
        return replica.reason or "the engine failed"
    if (
        replica.state is ReplicaState.STARTING
        and not replica.draining
        and now - replica.created_at > spec.start_timeout_s
    ):
        return f"not ready within its start timeout of {spec.start_timeout_s:g} s"
    return None


def _desired(record: ModelRecord, replicas: list[ReplicaRecord], now: float) -> int:
    """clamp(min, demand, max).

    An on-demand model is in demand when a request asked for it within its
    idle timeout, or while one of its replicas is busy or was used within
    it; load-driven scale-up (``load_demand``, extra replicas the gateways'
    load calls for) is added on top of that, or of the minimum for an
    always-on model.
    """
    spec = record.spec
    if spec.on_demand:
        asked = record.demand_at is not None and now - record.demand_at <= spec.idle_timeout_s
        in_use = any(_idle(r, now) < spec.idle_timeout_s for r in replicas)
        base = 1 if asked or in_use else 0
    else:
        base = spec.min_replicas
    return max(spec.min_replicas, min(base + max(0, record.load_demand), spec.max_replicas))


def _idle(replica: ReplicaRecord, now: float) -> float:
    if replica.in_flight > 0:
        return 0.0
    latest = max(replica.last_request_at or 0.0, replica.ready_at or 0.0, replica.created_at)
    return max(0.0, now - latest)


def _retire_order(replica: ReplicaRecord, now: float) -> tuple[int, float, str]:
    # Not serving first (starting replicas hold no cache yet), then idle
    # longest first; the id makes the order total, so the planner and the
    # reconciler pick the same replica.
    serving = replica.state is ReplicaState.READY
    return (1 if serving else 0, -_idle(replica, now), replica.id)


def _retire(
    out: Decisions,
    replica: ReplicaRecord,
    kind: str,
    why: str,
    now: float,
    *,
    always_drain: bool = False,
) -> None:
    """Stop a replica: a serving one through draining, any other at once."""
    serving = replica.state is ReplicaState.READY
    if serving and (always_drain or replica.in_flight > 0):
        out.mark_draining.append(replica)
        out.draining_since[replica.id] = now
        out.event(
            "drain",
            replica.model,
            f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)}"
            f" is draining ({kind}: {why})",
            replica=replica.id,
            step="draining",
        )
        return
    out.removals.append(Removal(replica, kind))
    out.event(
        kind,
        replica.model,
        f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)} removed"
        f" ({kind}: {why})",
        replica=replica.id,
    )


def _finish_drain(
    out: Decisions,
    replica: ReplicaRecord,
    now: float,
    policy: Policy,
    known: dict[str, float],
) -> None:
    since = known.get(replica.id)
    if since is None:
        # Marked by an earlier leader, or before a restart: start the clock.
        out.draining_since[replica.id] = now
        since = now
    waited = now - since
    if (
        replica.state is ReplicaState.FAILED
        or (replica.in_flight == 0 and waited >= policy.drain_grace_s)
        or waited >= policy.drain_timeout_s
    ):
        out.removals.append(Removal(replica, "drained"))
        out.event(
            "drain",
            replica.model,
            f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)} removed"
            f" after draining for {waited:.0f} s",
            replica=replica.id,
            step="removed",
        )


class _ShapeCheck:
    """Does a replica still match its model's entry (shards, devices, class)?

    A catalog edit that changes the shape (gpus, nodes, classes) makes old
    replicas wrong; they are replaced make-before-break like those on a
    draining node. Device classes are looked up lazily per node.
    """

    def __init__(self, state: FleetState, cache: DeviceCache) -> None:
        self.state = state
        self._cache = cache

    def fits(self, replica: ReplicaRecord, spec: ModelSpec) -> bool:
        if len(replica.shards) != spec.nodes:
            return False
        per_node = spec.gpus // max(1, spec.nodes)
        for shard in replica.shards:
            if len(shard.device_numbers) != per_node:
                return False
            classes = self._node_classes(shard.node)
            for number in shard.device_numbers:
                gpu_class = classes.get(number)
                # A device missing from the inventory is the agent's to
                # explain (it reports the replica failed); not a shape change.
                if gpu_class is not None and gpu_class not in spec.gpu_classes:
                    return False
        return True

    def _node_classes(self, node: str) -> dict[int, str]:
        record = self.state.nodes.get(node)
        return self._cache.get(record).device_class if record is not None else {}


# ---------------------------------------------------------------------------
# Phase two: placement (and eviction of idle on-demand replicas for room)
# ---------------------------------------------------------------------------


def _evictable(
    state: FleetState, out: Decisions, now: float, policy: Policy
) -> list[ReplicaRecord]:
    """Idle on-demand replicas, longest idle first."""
    leaving = {r.replica.id for r in out.removals} | {r.id for r in out.mark_draining}
    found = []
    for replica in state.replicas.values():
        record = state.models.get(replica.model)
        if record is None or not record.spec.on_demand or replica.id in leaving:
            continue
        if replica.state is not ReplicaState.READY or replica.draining or replica.in_flight:
            continue
        if _idle(replica, now) >= policy.evict_min_idle_s:
            found.append(replica)
    found.sort(key=lambda r: (-_idle(r, now), r.id))
    return found


def _place_model(
    out: Decisions,
    snapshot: Snapshot,
    placer: Placer,
    item: _Work,
    evictable: list[ReplicaRecord],
    failed_shapes: set[Request],
) -> None:
    spec = item.record.spec
    request = Request.for_spec(spec)
    shape = replace(request, model="")
    outcome = item.outcome
    outcome.status = PLACING
    for index in range(item.to_place):
        expect_failure = item.record.unplaceable_reason is not None or shape in failed_shapes
        result = placer.place(snapshot, request, expect_unplaceable=expect_failure)
        if isinstance(result, Unplaceable) and result.status == CANNOT_FIT_NOW:
            evicted = _make_room(out, snapshot, placer, request, evictable)
            if evicted is not None:
                result = evicted
        if isinstance(result, Unplaceable):
            failed_shapes.add(shape)
            outcome.unplaceable = result
            outcome.status = result.status
            placed = len(outcome.placed)
            outcome.reason = (
                f"{result.reason} (placed {placed} of {item.to_place} missing)"
                if placed
                else result.reason
            )
            return
        commit(snapshot, result)
        replica = ReplicaRecord(
            id=new_id(),
            model=spec.name,
            created_at=out.now,
            shards=result.shard_assignments(),
            state=ReplicaState.STARTING,
        )
        out.new.append(replica)
        outcome.placed.append((replica, result))
        where = ", ".join(f"{s.node}[{','.join(str(n) for n in s.numbers)}]" for s in result.shards)
        replaces = item.moving_ids[index] if index < len(item.moving_ids) else None
        extra = f", replacing {replaces}" if replaces else ""
        score = result.candidates[0].score if result.candidates else None
        out.event(
            "placed",
            spec.name,
            f"placed replica {replica.id} of {spec.name} on {where}{extra}",
            replica=replica.id,
            node=result.shards[0].node,
            gpu_class=result.shards[0].gpu_class,
            fabric=result.fabric,
            score=score,
            replaces=replaces,
        )


def _make_room(
    out: Decisions,
    snapshot: Snapshot,
    placer: Placer,
    request: Request,
    evictable: list[ReplicaRecord],
) -> Placement | None:
    """Unload idle on-demand replicas of other models, longest idle first,
    until the request fits; evict nothing if it never does."""
    wanted = set(request.classes)
    tried: list[ReplicaRecord] = []
    for victim in list(evictable):
        if victim.model == request.model or not _holds_class(snapshot, victim, wanted):
            continue
        snapshot.release_replica(victim)
        tried.append(victim)
        placement = placer.try_place(snapshot, request)
        if placement is None:
            continue
        used = {(s.node, n) for s in placement.shards for n in s.numbers}
        for replica in tried:
            held = {(s.node, n) for s in replica.shards for n in s.device_numbers}
            if held & used:
                evictable.remove(replica)
                out.removals.append(Removal(replica, "evicted"))
                out.event(
                    "evicted",
                    replica.model,
                    f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)}"
                    f" unloaded to make room for {request.model}",
                    replica=replica.id,
                    for_model=request.model,
                )
            else:
                snapshot.allocate_replica(replica)
        return placement
    for replica in tried:
        snapshot.allocate_replica(replica)
    return None


def _holds_class(snapshot: Snapshot, replica: ReplicaRecord, classes: set[str]) -> bool:
    for shard in replica.shards:
        view = snapshot.nodes.get(shard.node)
        if view is None:
            continue
        if any(view.device_class.get(n) in classes for n in shard.device_numbers):
            return True
    return False


__all__ = [
    "BACKING_OFF",
    "CANNOT_FIT_NOW",
    "CAN_NEVER_FIT",
    "PARKED",
    "PLACING",
    "SATISFIED",
    "Decisions",
    "ModelOutcome",
    "ModelUpdate",
    "Policy",
    "Removal",
    "decide",
]
