"""The kept snapshot equals a freshly built one after any change to the fleet.

Placement takes the first feasible nodes of each index, so equal means the
same views and the same order in every index; the planner builds its own
snapshot and must predict the reconciler's placements.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.control.scheduler.keeper import SnapshotKeeper
from llmgw.control.scheduler.snapshot import PlacementSnapshot, build_snapshot
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.sim.fleetgen import cpu_node, fleet, gpu_node, model
from llmgw.wire import NodeInventory, NodeState, ShardAssignment, WeightsEntry

NOW = 10_000.0
MODELS = ["m0", "m1", "m2"]


def picture(snapshot: PlacementSnapshot) -> dict[str, object]:
    """Everything placement reads, orders included."""
    views = {
        name: (
            view.state, view.fabrics, view.weights, view.free, view.capacity, view.total,
            {c: n for c, n in view.used.items() if n}, view.unhealthy, view.out_of_placement,
            view.replicas, view.used_total, view.capacity_total, view.memory_total_mib,
            view.memory_used_mib, view.cpu_bf16,
        )
        for name, view in snapshot.nodes.items()
    }
    classes = sorted({c for view in snapshot.nodes.values() for c in view.total})
    return {
        "order": list(snapshot.nodes),
        "views": views,
        "buckets": {c: {k: list(v) for k, v in snapshot.buckets(c).items() if v}
                    for c in classes},
        "whole": {c: {k: list(v) for k, v in snapshot.whole_free(c).items() if v}
                  for c in classes},
        "holders": {m: list(snapshot.holders(m)) for m in MODELS},
        "classes": {c: list(snapshot.class_nodes(c)) for c in classes},
        "ram": snapshot.ram_need,
    }


def start() -> FleetState:
    nodes = [
        gpu_node(f"n{i}", gpus=4, fabrics=["ib-a"] if i % 2 else ["ib-b"],
                 mig={3: ("3g.40gb", 2)} if i == 2 else None, seen_at=NOW,
                 weights=MODELS[: i % 3])
        for i in range(6)
    ] + [cpu_node("c0", slots=2, seen_at=NOW)]
    return fleet(nodes, [model(m) for m in MODELS], NOW)


step = st.tuples(
    st.sampled_from([
        "add", "add", "add", "remove", "replace-record", "cordon", "silence", "inventory",
        "same-inventory", "ram", "weights", "fabrics", "new-node", "drop-node",
    ]),
    st.integers(0, 1000),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(step, max_size=6), min_size=1, max_size=6), st.data())
def test_the_kept_snapshot_is_the_built_one(
    passes: list[list[tuple[str, int]]], data: st.DataObject
) -> None:
    state = start()
    keeper = SnapshotKeeper()
    counter = 0
    for changes in passes:
        for kind, roll in changes:
            names = sorted(state.nodes)
            name = names[roll % len(names)]
            node = state.nodes[name]
            rids = sorted(state.replicas)
            if kind == "add" and node.inventory is not None:
                counter += 1
                numbers = [d.number for d in node.inventory.devices][roll % 2:][:1 + roll % 2]
                state.replicas[f"r{counter}"] = ReplicaRecord(
                    id=f"r{counter}", model=MODELS[roll % 3], created_at=NOW,
                    shards=[ShardAssignment(node=name, device_numbers=numbers)],
                )
            elif kind == "remove" and rids:
                del state.replicas[rids[roll % len(rids)]]
            elif kind == "replace-record" and rids:
                old = state.replicas[rids[roll % len(rids)]]
                state.replicas[old.id] = ReplicaRecord(
                    id=old.id, model=old.model, created_at=NOW, shards=list(old.shards))
            elif kind == "cordon":
                node.admin_state = (NodeState.CORDONED if node.admin_state is NodeState.READY
                                    else NodeState.READY)
            elif kind == "silence":
                node.last_seen = NOW - 1000 if node.last_seen == NOW else NOW
            elif kind in ("inventory", "same-inventory") and node.inventory is not None:
                devices = [d.model_copy() for d in node.inventory.devices]
                if kind == "inventory":
                    devices[roll % len(devices)] = devices[roll % len(devices)].model_copy(
                        update={"healthy": not devices[roll % len(devices)].healthy})
                node.inventory = NodeInventory(hostname=name, source="fake", devices=devices)
            elif kind == "ram" and node.inventory is not None:
                # A node's RAM facts (what placement charges CPU shards by) move.
                node.inventory = node.inventory.model_copy(update={
                    "memory_total_mib": [None, 16384, 65536][roll % 3],
                    "cpu_bf16": [None, True, False][(roll // 3) % 3],
                })
            elif kind == "weights":
                node.weights = [
                    WeightsEntry(model=m) for i, m in enumerate(MODELS) if (roll >> i) & 1
                ]
            elif kind == "fabrics":
                node.fabrics = [["ib-a"], ["ib-b"], []][roll % 3]
            elif kind == "new-node":
                counter += 1
                added = gpu_node(f"a{counter}", gpus=2, seen_at=NOW)
                state.nodes[added.name] = added
            elif kind == "drop-node" and len(state.nodes) > 1:
                del state.nodes[name]
        exclude = data.draw(st.sets(st.sampled_from(sorted(state.replicas) or ["none"]),
                                    max_size=2))
        kept = keeper.snapshot(state, NOW, exclude=exclude)
        built = build_snapshot(state, NOW, exclude=exclude)
        assert picture(kept) == picture(built)
        # What a pass does to its fork never shows in the next pass's.
        for view in list(kept.nodes.values())[:3]:
            for numbers in view.free.values():
                if numbers:
                    kept.allocate(view.name, numbers[:1], "m0")
                    break
    assert picture(keeper.snapshot(state, NOW)) == picture(build_snapshot(state, NOW))
