"""Placement on small hand-built fleets, and the wording of unplaceable reasons."""

from __future__ import annotations

from llmgw.control.scheduler.explain import CAN_NEVER_FIT, CANNOT_FIT_NOW
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placed import Placement, Unplaceable, commit
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.snapshot import PlacementSnapshot, build_snapshot
from llmgw.control.state import NodeRecord
from llmgw.sim.fleetgen import cpu_node, fleet, gpu_node, model
from llmgw.wire import ModelSpec, NodeState

NOW = 1000.0


def snap(*nodes: NodeRecord) -> PlacementSnapshot:
    return build_snapshot(fleet(nodes, []), NOW)


def place(snapshot: PlacementSnapshot, spec: ModelSpec) -> Placement:
    result = Placer().place(snapshot, Request.for_spec(spec))
    assert isinstance(result, Placement), getattr(result, "reason", result)
    commit(snapshot, result)
    return result


def refuse(snapshot: PlacementSnapshot, spec: ModelSpec) -> Unplaceable:
    result = Placer().place(snapshot, Request.for_spec(spec))
    assert isinstance(result, Unplaceable), result
    return result


def test_single_gpu_replicas_fill_one_node_before_starting_another() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW), gpu_node("b", seen_at=NOW))
    first = place(snapshot, model("one"))
    second = place(snapshot, model("two"))
    assert first.shards[0].node == second.shards[0].node
    assert first.shards[0].numbers == (0,) and second.shards[0].numbers == (1,)
    assert first.shards[0].uuids == (f"GPU-{first.shards[0].node}-0",)


def test_a_partly_used_node_is_preferred_over_a_whole_one() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW), gpu_node("b", seen_at=NOW))
    snapshot.allocate("b", [0, 1, 2, 3], "other")
    assert place(snapshot, model("m", gpus=2)).shards[0].node == "b"


def test_weights_outrank_packing_and_spreading() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW), gpu_node("b", seen_at=NOW, weights=["m"]))
    snapshot.allocate("a", [0, 1, 2, 3], "other")
    result = place(snapshot, model("m"))
    assert result.shards[0].node == "b"
    best = result.candidates[0]
    assert dict(best.scores)["weights-local"] == 1.0
    assert best.score > result.candidates[1].score


def test_replicas_of_one_model_spread_over_nodes() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW), gpu_node("b", seen_at=NOW))
    nodes = {place(snapshot, model("m")).shards[0].node for _ in range(2)}
    assert nodes == {"a", "b"}


def test_cordoned_draining_and_unreachable_nodes_get_nothing() -> None:
    snapshot = snap(
        gpu_node("a", seen_at=NOW, admin_state=NodeState.CORDONED),
        gpu_node("b", seen_at=NOW, admin_state=NodeState.DRAINING),
        gpu_node("c", seen_at=NOW - 60),
        gpu_node("d", seen_at=NOW),
    )
    assert {place(snapshot, model(f"m{i}", gpus=4)).shards[0].node for i in range(2)} == {"d"}
    refused = refuse(snapshot, model("m9", gpus=4))
    assert refused.status == CANNOT_FIT_NOW
    assert refused.reason == (
        "needs 4 free h100-80g on one node; 0/4 nodes fit:"
        " 1 cordoned, 1 draining, 1 too few free h100-80g (at most 0 free), 1 unreachable"
    )


def test_mig_replica_gets_exactly_one_instance() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW, gpus=2, mig={1: ("3g.40gb", 2)}))
    result = place(snapshot, model("m", classes=["h100-80g-mig-3g.40gb"]))
    assert result.shards[0].numbers == (1100,)  # discovery numbers instances from 0
    assert result.shards[0].uuids == ("MIG-a-1-1",)
    refused = refuse(snapshot, model("big", classes=["h100-80g-mig-3g.40gb"], gpus=2))
    assert refused.status == CAN_NEVER_FIT
    assert refused.reason == (
        "needs 2 devices per replica but accepts only MIG class h100-80g-mig-3g.40gb:"
        " a replica on MIG runs on exactly one instance"
    )


def test_several_replicas_of_one_cpu_model_on_one_node_take_a_slot_each() -> None:
    snapshot = snap(cpu_node("c", slots=3, seen_at=NOW))
    slots = [place(snapshot, model("tiny", classes=["cpu"])).shards[0].numbers for _ in range(3)]
    assert sorted(slots) == [(0,), (1,), (2,)]
    refused = refuse(snapshot, model("tiny", classes=["cpu"]))
    assert refused.reason == (
        "needs 1 free cpu on one node; 0/1 nodes fit: 1 too few free cpu (at most 0 free)"
    )


def two_fabrics(*more: NodeRecord) -> list[NodeRecord]:
    """Two eight-card nodes on fabric ib-a and two on ib-b, then ``more``."""
    nodes = [gpu_node(f"{f}{n}", seen_at=NOW, fabrics=[f"ib-{f}"]) for f in "ab" for n in (1, 2)]
    return [*nodes, *more]


def test_multi_node_replica_takes_whole_free_nodes_of_one_fabric() -> None:
    snapshot = snap(*two_fabrics(gpu_node("b3", seen_at=NOW, fabrics=["ib-b"], weights=["big"])))
    snapshot.allocate("a1", [0], "small")
    result = place(snapshot, model("big", gpus=16, nodes=2))
    assert result.fabric == "ib-b"
    nodes = [s.node for s in result.shards]
    assert nodes[0] == "b3" and len(set(nodes)) == 2
    assert all(s.numbers == tuple(range(8)) for s in result.shards)
    assert [a.rank for a in result.shard_assignments()] == [0, 1]


def test_multi_node_wording_names_each_fabric() -> None:
    snapshot = snap(*two_fabrics())
    snapshot.allocate("a1", [0], "small")
    snapshot.allocate("b1", [0], "small")
    snapshot.allocate("b2", [0], "small")
    refused = refuse(snapshot, model("big", gpus=16, nodes=2))
    assert refused.status == CANNOT_FIT_NOW
    assert refused.reason == (
        "needs 2 nodes with 8 free h100-80g in one fabric; ib-a has 1 such node, ib-b has 0;"
        " 1/4 nodes fit: 3 not entirely free"
    )


def test_can_never_fit_when_no_node_is_large_enough_or_the_class_is_missing() -> None:
    snapshot = snap(gpu_node("a", seen_at=NOW, gpus=4), gpu_node("b", seen_at=NOW, gpus=2))
    too_big = refuse(snapshot, model("m", gpus=8))
    assert too_big.status == CAN_NEVER_FIT
    assert too_big.reason == (
        "needs 8 h100-80g on one node; no node has that many (the largest has 4)"
    )
    missing = refuse(snapshot, model("m", classes=["b200-192g"]))
    assert missing.status == CAN_NEVER_FIT
    assert missing.reason == "needs 1 b200-192g on one node; no node has b200-192g"
    # No node at all (`llmgw up` before its agent registered) says just that.
    empty = refuse(snap(), model("m"))
    assert empty.reason == "needs 1 h100-80g on one node; no node has joined the fleet yet"
    split = refuse(
        snap(
            gpu_node("a", seen_at=NOW, fabrics=["ib-a"]),
            gpu_node("b", seen_at=NOW, fabrics=["ib-b"]),
        ),
        model("m", gpus=16, nodes=2),
    )
    assert split.status == CAN_NEVER_FIT
    assert split.reason == (
        "needs 2 nodes with 8 h100-80g in one fabric; ib-a has 1 such node, ib-b has 1"
    )


def test_fleet_wide_wording_counts_each_node_once_by_its_first_reason() -> None:
    nodes = [gpu_node(f"h{i}", seen_at=NOW) for i in range(5)]
    nodes += [gpu_node(f"l{i}", gpu_class="l4-24g", seen_at=NOW) for i in range(3)]
    nodes.append(gpu_node("sick", seen_at=NOW, unhealthy=[0, 1, 2, 3, 4]))
    nodes.append(gpu_node("off", seen_at=NOW, admin_state=NodeState.CORDONED))
    snapshot = snap(*nodes)
    for i in range(5):
        snapshot.allocate(f"h{i}", [0, 1, 2, 3, 4, 5], "other")
    refused = refuse(snapshot, model("m", gpus=4))
    assert refused.reason == (
        "needs 4 free h100-80g on one node; 0/10 nodes fit:"
        " 5 too few free h100-80g (at most 2 free), 3 no h100-80g, 1 cordoned,"
        " 1 too few healthy h100-80g"
    )
    assert sum(refused.counts.values()) == 10


def test_mig_class_refuses_tp_pp_and_nodes_above_one_each_on_its_own() -> None:
    # Catalog validation refuses these too; placement refuses them again for
    # a catalog edited around it. Built field by field, as such an edit would.
    snapshot = snap(
        gpu_node("a", seen_at=NOW, gpus=2, mig={1: ("3g.40gb", 2)}),
        gpu_node("b", seen_at=NOW, gpus=2, mig={1: ("3g.40gb", 2)}),
    )
    one = model("m", classes=["h100-80g-mig-3g.40gb"])
    # A shape of one device names what splits it, never "needs 1 devices".
    shapes = {
        "tp": "is split (tp 2)",
        "pp": "is split (pp 2)",
        "nodes": "needs 2 devices per replica",
        "gpus": "needs 2 devices per replica",
    }
    for field, value in (("tp", 2), ("pp", 2), ("nodes", 2), ("gpus", 2)):
        refused = refuse(snapshot, one.model_copy(update={field: value}))
        assert refused.status == CAN_NEVER_FIT, field
        assert refused.reason == (
            f"{shapes[field]} but accepts only MIG class h100-80g-mig-3g.40gb:"
            " a replica on MIG runs on exactly one instance"
        ), (field, refused.reason)
    assert place(snapshot, one).shards[0].numbers == (1100,)  # the plain shape still fits
