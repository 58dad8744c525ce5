"""Phase two of a pass: place what each model is short of, making room where allowed.

Each new replica is committed to the snapshot before the next is placed, so
one pass never places two replicas on the same device.
"""

from __future__ import annotations

from dataclasses import replace

from llmgw.control.scheduler.decisions import PLACING, Decisions, ModelWork
from llmgw.control.scheduler.eviction import make_room
from llmgw.control.scheduler.explain import CANNOT_FIT_NOW
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placed import Unplaceable, commit
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.snapshot import PlacementSnapshot
from llmgw.control.state import ReplicaRecord
from llmgw.secrets import new_id
from llmgw.wire import ReplicaState


def place_shortfall(
    out: Decisions,
    snapshot: PlacementSnapshot,
    placer: Placer,
    item: ModelWork,
    evictable: list[ReplicaRecord],
    failed_shapes: set[Request],
) -> None:
    spec = item.record.spec
    outcome = item.outcome
    request = Request.for_spec(spec, snapshot.ram_need.get(spec.name))
    # Shapes that failed are remembered without the model or its avoided
    # nodes: an Unplaceable is the answer with every node allowed anyway.
    shape = replace(request, model="")
    if outcome.avoided:
        request = replace(request, avoid=frozenset(a.node for a in outcome.avoided))
    outcome.status = PLACING
    for index in range(item.to_place):
        expect_failure = item.record.unplaceable_reason is not None or shape in failed_shapes
        result = placer.place(snapshot, request, expect_unplaceable=expect_failure)
        if isinstance(result, Unplaceable) and result.status == CANNOT_FIT_NOW:
            evicted = make_room(out, snapshot, placer, request, evictable)
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
        if request.avoid:
            used = {s.node for s in result.shards} & request.avoid
            outcome.used_anyway |= used
            extra += (
                f", although {spec.name} failed there recently: no other node fits"
                if used
                else f"; avoided {', '.join(sorted(request.avoid))} after failures there"
            )
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
