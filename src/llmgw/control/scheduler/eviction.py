"""Making room: unloading idle on-demand replicas of other models for a placement."""

from __future__ import annotations

from llmgw.control.scheduler.decisions import Decisions, Policy, Removal
from llmgw.control.scheduler.demand import idle_for
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placed import Placement
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.snapshot import PlacementSnapshot
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import ReplicaState


def evictable_replicas(
    state: FleetState, out: Decisions, now: float, policy: Policy
) -> list[ReplicaRecord]:
    """Idle on-demand replicas, longest idle first."""
    leaving = {r.replica.id for r in out.removals} | {r.id for r in out.mark_draining}
    found = []
    # By model: on-demand models' replicas only, not a scan of every replica.
    for record in state.models.values():
        if not record.spec.on_demand:
            continue
        for replica in state.replicas.of_model(record.name):
            if replica.id in leaving:
                continue
            if replica.state is not ReplicaState.READY or replica.draining or replica.in_flight:
                continue
            if idle_for(replica, now) >= policy.evict_min_idle_s:
                found.append(replica)
    found.sort(key=lambda r: (-idle_for(r, now), r.id))
    return found


def make_room(
    out: Decisions,
    snapshot: PlacementSnapshot,
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


def _holds_class(snapshot: PlacementSnapshot, replica: ReplicaRecord, classes: set[str]) -> bool:
    for shard in replica.shards:
        view = snapshot.nodes.get(shard.node)
        if view is None:
            continue
        if any(view.device_class.get(n) in classes for n in shard.device_numbers):
            return True
    return False
