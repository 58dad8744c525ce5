"""Each filter and scorer alone, on hand-built node views."""

from __future__ import annotations

from llmgw.control.scheduler import filters as f
from llmgw.control.scheduler.placementnode import PlacementNode, placement_node
from llmgw.control.scheduler.scorers import BinPack, Spread, WeightsLocal
from llmgw.sim.fleetgen import cpu_node, gpu_node, model
from llmgw.wire import NodeState

NOW = 100.0


def view(**kwargs: object) -> PlacementNode:
    return placement_node(gpu_node("n1", seen_at=NOW, **kwargs), NOW)  # type: ignore[arg-type]


def request(**kwargs: object) -> f.Request:
    return f.Request.for_spec(model("m", **kwargs))  # type: ignore[arg-type]


def test_node_ready_names_the_state() -> None:
    check = f.NodeReady()
    assert check.check(view(), request()) is None
    for state, reason in [
        (NodeState.CORDONED, f.CORDONED),
        (NodeState.DRAINING, f.DRAINING),
    ]:
        rejection = check.check(view(admin_state=state), request())
        assert rejection is not None and rejection.reason == reason
    stale = placement_node(gpu_node("n2", seen_at=NOW - 31), NOW)
    rejection = check.check(stale, request())
    assert rejection is not None and rejection.reason == f.UNREACHABLE
    assert rejection.dimension == "node state"


def test_class_accepted() -> None:
    check = f.ClassAccepted()
    assert check.check(view(), request(classes=["l4-24g", "h100-80g"])) is None
    rejection = check.check(view(), request(classes=["l4-24g"]))
    assert rejection is not None
    assert (rejection.reason, rejection.dimension) == (f.NO_CLASS, "l4-24g")


def test_mig_single_instance_refuses_sharded_replicas_on_mig_nodes_only() -> None:
    mig = view(gpus=1, mig={0: ("3g.40gb", 2)})
    check = f.MigSingleInstance()
    one = request(classes=["h100-80g-mig-3g.40gb"])
    assert one.classes == ("h100-80g-mig-3g.40gb",)
    assert check.check(mig, one) is None
    two = request(classes=["h100-80g-mig-3g.40gb"], gpus=2)
    assert two.classes == () and two.mig_refused == ("h100-80g-mig-3g.40gb",)
    rejection = check.check(mig, two)
    assert rejection is not None and rejection.reason == f.MIG_ONE_INSTANCE
    assert (rejection.requested, rejection.capacity) == (2, 1)
    # A whole-card class in the same request is still usable elsewhere.
    mixed = request(classes=["h100-80g-mig-3g.40gb", "h100-80g"], gpus=2)
    assert check.check(view(), mixed) is None


def test_enough_free_devices_says_free_healthy_or_too_small() -> None:
    check = f.EnoughFreeDevices()
    assert check.check(view(), request(gpus=8)) is None
    unhealthy = check.check(view(unhealthy=[0, 1]), request(gpus=8))
    assert unhealthy is not None
    assert (unhealthy.reason, unhealthy.requested, unhealthy.available, unhealthy.capacity) == (
        f.TOO_FEW_HEALTHY,
        8,
        6,
        6,
    )
    small = check.check(view(gpus=4), request(gpus=8))
    assert small is not None and small.reason == f.TOO_SMALL
    busy = view()
    busy.free["h100-80g"] = [6, 7]
    full = check.check(busy, request(gpus=4))
    assert full is not None
    assert (full.reason, full.dimension, full.available, full.capacity) == (
        f.TOO_FEW_FREE,
        "h100-80g",
        2,
        8,
    )


def test_mig_card_with_nothing_carved_is_out_of_placement() -> None:
    node = view(gpus=2, mig={1: ("3g.40gb", 0)})
    assert node.capacity == {"h100-80g": 1}
    assert node.out_of_placement == {"h100-80g": 1}
    rejection = f.EnoughFreeDevices().check(node, request(gpus=2))
    assert rejection is not None and rejection.reason == f.TOO_FEW_HEALTHY


def test_whole_node_and_fabric_apply_to_multi_node_requests_only() -> None:
    used = view()
    used.used_total = 1
    multi = request(gpus=16, nodes=2)
    assert f.WholeNode().check(view(), multi) is None
    rejection = f.WholeNode().check(used, multi)
    assert rejection is not None and rejection.reason == f.NOT_ENTIRELY_FREE
    assert f.WholeNode().check(used, request()) is None
    no_fabric = view(fabrics=())
    rejection = f.InFabric().check(no_fabric, multi)
    assert rejection is not None and rejection.reason == f.NO_FABRIC
    assert f.InFabric().check(no_fabric, request()) is None


def test_cpu_slots_are_devices_of_class_cpu() -> None:
    node = placement_node(cpu_node("c1", slots=3, seen_at=NOW), NOW)
    assert node.free == {"cpu": [0, 1, 2]}
    assert f.EnoughFreeDevices().check(node, request(classes=["cpu"])) is None


def test_weights_scorer() -> None:
    scorer = WeightsLocal()
    assert scorer.score(view(weights=["m"]), request()) == 1.0
    assert scorer.score(view(weights=["other"]), request()) == 0.0


def test_bin_pack_prefers_partly_used_nodes() -> None:
    scorer = BinPack()
    empty, half = view(), view()
    half.used_total = 4
    assert scorer.score(empty, request()) == 1 / 8
    assert scorer.score(half, request()) == 5 / 8
    assert scorer.score(half, request(gpus=4)) == 1.0


def test_spread_prefers_nodes_without_the_model() -> None:
    scorer = Spread()
    crowded = view()
    crowded.replicas["m"] = 2
    assert scorer.score(view(), request()) == 1.0
    assert scorer.score(crowded, request()) == 1 / 3
