"""One label per device in every view: node, replica and plan views agree (wire.device_label)."""

from __future__ import annotations

from llmgw.control.adminapi.views.fleet import fleet_views
from llmgw.control.scheduler.planner import plan
from llmgw.control.state import ReplicaRecord
from llmgw.sim.fleetgen import cpu_node, fleet, gpu_node, model
from llmgw.wire import CPU_CLASS, ReplicaState, ShardAssignment, device_label, device_label_on

NOW = 500.0


def test_the_label_function() -> None:
    assert [device_label(3), device_label(1001), device_label(1205)] == ["3", "0/mig1", "2/mig5"]
    assert device_label(0, CPU_CLASS) == "cpu0"
    node = cpu_node("c", slots=2).inventory
    assert node is not None
    assert device_label_on(node.devices, 1) == "cpu1"
    assert device_label_on(node.devices, 7) == "cpu7"  # not listed: still a CPU slot
    gpus = gpu_node("g", gpus=2).inventory
    assert gpus is not None and device_label_on(gpus.devices, 7) == "7"


def test_node_replica_and_plan_views_label_devices_alike() -> None:
    nodes = [
        cpu_node("c", slots=2, seen_at=NOW),
        gpu_node("g", gpus=2, mig={1: ("3g.40gb", 2)}, seen_at=NOW),
    ]
    models = [
        model("small", classes=[CPU_CLASS], min_replicas=2),
        model("big", classes=["h100-80g"]),
        model("slice", classes=["h100-80g-mig-3g.40gb"]),
    ]
    state = fleet(nodes, models, NOW)
    for rid, name, node, number in (
        ("r-cpu", "small", "c", 1), ("r-gpu", "big", "g", 0), ("r-mig", "slice", "g", 1101),
    ):
        state.replicas[rid] = ReplicaRecord(
            id=rid, model=name, created_at=NOW, ready_at=NOW, state=ReplicaState.READY,
            shards=[ShardAssignment(node=node, device_numbers=[number])],
        )
    views = fleet_views(state, NOW)
    node_labels = {
        (n.name, d.number): d.label for n in views.nodes for d in n.devices or []
    }
    assert node_labels[("c", 1)] == "cpu1" and node_labels[("g", 1101)] == "1/mig1"
    shown = {r.id: r.shards[0].devices for r in views.replicas}
    assert shown == {"r-cpu": ["cpu1"], "r-gpu": ["0"], "r-mig": ["1/mig1"]}
    for replica in views.replicas:
        shard = replica.shards[0]
        assert shard.devices == [node_labels[(shard.node, n)] for n in shard.device_numbers]

    result = plan(state, NOW)
    devices = {r.id: r.devices for m in result.models for r in m.replicas}
    assert devices["r-cpu"] == ["c:cpu1"]
    assert devices["r-gpu"] == ["g:0"] and devices["r-mig"] == ["g:1/mig1"]
    [placed] = [r for m in result.models for r in m.replicas if r.action == "place"]
    assert placed.devices == ["c:cpu0"]  # the second replica of "small", on the free slot
