"""The planner: device counts, statuses, candidates, what-if, JSON."""

from __future__ import annotations

import json

from llmgw.control.scheduler.decide import decide
from llmgw.control.scheduler.planner import plan
from llmgw.control.state import ReplicaRecord
from llmgw.sim.fleetgen import fleet, gpu_node, model
from llmgw.wire import ReplicaState, ShardAssignment

NOW = 500.0


def test_devices_are_counted_by_class() -> None:
    nodes = [
        gpu_node("a", gpus=4, unhealthy=[3], mig={2: ("3g.40gb", 2)}, seen_at=NOW),
        gpu_node("b", gpus=2, mig={1: ("3g.40gb", 0)}, seen_at=NOW - 100),  # unreachable
    ]
    state = fleet(nodes, [model("m", gpus=2)], NOW)
    state.replicas["r1"] = ReplicaRecord(
        id="r1",
        model="m",
        created_at=NOW,
        shards=[ShardAssignment(node="a", device_numbers=[0, 1], device_uuids=["x", "y"])],
        state=ReplicaState.READY,
    )
    result = plan(state, NOW)
    counts = {d.gpu_class: d.model_dump() for d in result.devices}
    assert counts["h100-80g"] == {
        "gpu_class": "h100-80g",
        "total": 5,
        "used": 2,
        "free": 1,
        "unhealthy": 1,
        "out_of_placement": 1,
        "free_ready": 0,
        "free_after": 1,
    }
    assert counts["h100-80g-mig-3g.40gb"]["free_ready"] == 2
    assert result.nodes == {"ready": 1, "unreachable": 1}
    (m,) = result.models
    assert (m.status, m.desired, m.current) == ("satisfied", 1, 1)
    assert m.replicas[0].devices == ["a:0", "a:1"] and m.replicas[0].action == "keep"


def test_plan_shows_placements_with_candidate_scores_and_reasons() -> None:
    state = fleet(
        [
            gpu_node("a", seen_at=NOW),
            gpu_node("b", seen_at=NOW, weights=["m"]),
            gpu_node("c", seen_at=NOW),
            gpu_node("d", seen_at=NOW, weights=["big"]),
        ],
        [
            model("m", gpus=2),
            model("mig", classes=["h100-80g-mig-3g.40gb"]),
            model("big", gpus=16, nodes=2),
        ],
        NOW,
    )
    result = plan(state, NOW)
    by_name = {m.name: m for m in result.models}
    placed = by_name["m"]
    assert placed.status == "placing"
    assert [r.devices for r in placed.replicas] == [["b:0", "b:1"]]
    best = placed.candidates[0]
    assert best.node == "b" and best.scores["weights-local"] == 1.0
    assert placed.candidates[1].score < best.score
    assert by_name["mig"].status == "can never fit"
    assert by_name["mig"].reason == (
        "needs 1 h100-80g-mig-3g.40gb on one node; no node has h100-80g-mig-3g.40gb"
    )
    big = by_name["big"]
    assert big.status == "placing"
    assert big.replicas[0].fabric == "ib-a"
    assert big.replicas[0].nodes == ["d", "a"]  # weights first, rank 0 on it
    assert result.unplaceable == ["mig"]
    assert result.placements == 2
    # JSON-able as the admin API returns it.
    assert json.loads(result.model_dump_json())["models"][0]["name"] == "big"


def test_what_if_places_an_added_model_without_changing_anything() -> None:
    state = fleet([gpu_node("a", seen_at=NOW)], [model("m", gpus=4)], NOW)
    before = (dict(state.models), dict(state.replicas), state.routing_version)
    result = plan(state, NOW, what_if=[model("extra", gpus=4), model("toomuch", gpus=4)])
    assert result.what_if == ["extra", "toomuch"]
    statuses = {m.name: m.status for m in result.models}
    # Larger and always-on first, then by name: m and extra fit, toomuch does not.
    assert statuses == {"extra": "placing", "m": "placing", "toomuch": "cannot fit now"}
    assert (dict(state.models), dict(state.replicas), state.routing_version) == before


def test_the_planner_places_a_mig_replica_on_exactly_one_instance() -> None:
    nodes = [gpu_node("a", gpus=2, mig={1: ("3g.40gb", 2)}, seen_at=NOW)]
    state = fleet(nodes, [model("slice", classes=["h100-80g-mig-3g.40gb"], min_replicas=2)], NOW)
    result = plan(state, NOW)
    [slice_plan] = result.models
    placed = [r for r in slice_plan.replicas if r.action == "place"]
    assert [r.devices for r in placed] == [["a:1/mig0"], ["a:1/mig1"]]
    assert all(len(r.shards) == 1 and len(r.shards[0].device_numbers) == 1 for r in placed)
    assert result.unplaceable == []


def test_a_pass_says_nothing_is_unplaceable_about_a_parked_model() -> None:
    # The summary lists a parked model under unplaceable only while the
    # scheduler's last word says so (the reference's rule); a parked model is
    # not placed, so the next pass clears a reason left from before parking.
    state = fleet([gpu_node("a", gpus=1, seen_at=NOW)], [model("big", gpus=8)], NOW)
    record = state.models["big"]
    assert decide(state, NOW).reasons["big"] is not None  # 8 on a 1-card fleet
    record.parked, record.failures, record.last_error = True, 5, "engine exited (1)"
    record.unplaceable_reason = "needs 8 free h100-80g on one node"
    assert decide(state, NOW).reasons["big"] is None
