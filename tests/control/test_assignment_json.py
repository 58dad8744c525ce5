"""reports.AssignmentJson: each node's assignments as JSON, the same bytes as dumping
``assignments_for``'s models, through every change an assignment can see."""

from __future__ import annotations

import random

from llmgw.control.adapters import AdapterIndex
from llmgw.control.reports import AssignmentJson, assignments_for
from llmgw.control.scheduler.decide import decide
from llmgw.control.state import FleetState
from llmgw.sim import fleetgen
from llmgw.wire import ReplicaState, ShardAssignment


def _fleet() -> FleetState:
    state = fleetgen.generate(nodes=100, models=60, seed=1, now=1000.0)
    for replica in decide(state, 1000.0).new:
        state.replicas[replica.id] = replica
    assert any(len(r.shards) > 1 for r in state.replicas.values())
    return state


def _expected(state: FleetState, node: str, key: dict[str, str]) -> list[bytes]:
    return [a.model_dump_json().encode() for a in assignments_for(state, node, key.get)]


def _check(book: AssignmentJson, state: FleetState, keys: dict[str, str]) -> None:
    for name in state.nodes:
        assert book.for_node(state, name, keys.__getitem__) == _expected(state, name, keys)


def test_the_kept_json_follows_every_change() -> None:
    state = _fleet()
    rng = random.Random(1)
    keys = {rid: f"key-{rid}-{'x' * 16}" for rid in state.replicas}
    book = AssignmentJson(AdapterIndex())
    _check(book, state, keys)
    for step in range(60):
        replica = rng.choice(list(state.replicas.values()))
        change = step % 6
        if change == 0:
            replica.generation += 1
        elif change == 1:
            replica.state = (
                ReplicaState.DRAINING if replica.state == ReplicaState.READY else ReplicaState.READY
            )
        elif change == 2:
            model = state.models[replica.model]
            model.spec = model.spec.model_copy(update={"max_replicas": model.spec.max_replicas + 1})
        elif change == 3:
            keys[replica.id] = f"rotated-{step}-{'y' * 16}"
        elif change == 4:
            # A multi-node replica's leader moved address, and a shard replaced.
            replica = rng.choice([r for r in state.replicas.values() if len(r.shards) > 1])
            leader = state.nodes[replica.leader_node]
            leader.address = f"10.9.{step}.1"
            shard = replica.shards[0]
            replica.shards = [
                ShardAssignment(
                    node=shard.node,
                    rank=shard.rank,
                    device_numbers=list(reversed(shard.device_numbers)),
                    device_uuids=list(reversed(shard.device_uuids)),
                ),
                *replica.shards[1:],
            ]
        else:
            replica.state = (
                ReplicaState.FAILED
                if replica.state != ReplicaState.FAILED
                else (ReplicaState.READY)
            )
        _check(book, state, keys)
    # Replicas removed: their entries go once the book has outgrown the fleet.
    for rid in list(state.replicas)[: len(state.replicas) // 2]:
        del state.replicas[rid]
    for _ in range(3):
        _check(book, state, keys)
    assert len(book._kept) <= 2 * len(state.replicas) + 64 + 10
