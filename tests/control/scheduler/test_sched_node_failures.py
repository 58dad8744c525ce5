"""Failures by node: the book, the soft filter, placement around failed nodes, parking."""

from __future__ import annotations

from dataclasses import replace

from tests.control.scheduler.schedkit import fail_starts

from llmgw.control.scheduler import filters as f
from llmgw.control.scheduler.decide import decide
from llmgw.control.scheduler.decisions import BACKING_OFF, PARKED, Policy
from llmgw.control.scheduler.node_failures import Avoided, NodeFailureBook, span
from llmgw.control.scheduler.placed import Placement, Unplaceable
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.placementnode import placement_node
from llmgw.control.scheduler.planner import plan
from llmgw.control.scheduler.snapshot import build_snapshot
from llmgw.control.state import FleetState, NodeFailure, ReplicaRecord
from llmgw.sim.fleetgen import fleet, gpu_node, model
from llmgw.wire import ReplicaState, ShardAssignment

NOW = 10_000.0
POLICY = Policy()  # node backoff: 60 s after one failure there, doubling, at most 1 h


def test_node_backoff_doubles_from_a_minute_and_stops_at_an_hour() -> None:
    assert [POLICY.node_backoff(n) for n in (0, 1, 2, 3, 7)] == [0.0, 60.0, 120.0, 240.0, 3600.0]
    # A model stuck on one node is never parked, so counts grow without bound.
    assert POLICY.node_backoff(5000) == 3600.0 and POLICY.backoff(5000) == 300.0


def test_the_book_counts_clears_and_never_edits_the_map_it_was_given() -> None:
    given = {"a": NodeFailure(1, NOW - 100.0)}
    book = NodeFailureBook(given)
    book.failed(["a", "b"], NOW)
    assert book.entries == {"a": NodeFailure(2, NOW), "b": NodeFailure(1, NOW)}
    assert given == {"a": NodeFailure(1, NOW - 100.0)} and book.changed
    book.end_run()
    assert book.run_nodes() == []
    assert book.entries["a"] == NodeFailure(2, NOW, current_run=False)
    book.started("a", NOW - 1)  # created before the failure there: proves nothing
    assert "a" in book.entries
    book.started("a", NOW)
    assert "a" not in book.entries
    book.keep_only({"c"})
    assert book.entries == {}


def test_a_book_changes_only_what_a_pass_changes() -> None:
    in_run = NodeFailureBook({"a": NodeFailure(1, NOW)})
    in_run.end_run()
    assert in_run.changed
    # Nothing in the run to end, no entry for the node that started: the
    # record's own map comes back, and the model needs no write.
    given = {"a": NodeFailure(1, NOW, current_run=False)}
    quiet = NodeFailureBook(given)
    quiet.end_run()
    quiet.started("b", NOW)
    quiet.keep_only({"a"})
    assert not quiet.changed and quiet.entries is given


def test_avoided_nodes_expire_with_their_backoff() -> None:
    book = NodeFailureBook({"a": NodeFailure(2, NOW - 40.0), "b": NodeFailure(1, NOW - 61.0)})
    assert book.avoided(NOW, POLICY.node_backoff) == (Avoided("a", 2, NOW - 40.0, NOW + 80.0),)


def test_the_plan_sentence() -> None:
    avoided = Avoided("n3", 3, NOW - 40.0, NOW - 40.0 + 240.0)
    assert avoided.sentence("m", NOW) == (
        "n3: model m failed there 3 times, last 40 s ago; avoided for 3 min"
    )
    assert Avoided("n3", 1, NOW - 5.0, NOW + 55.0).sentence("m", NOW, used=True) == (
        "n3: model m failed there 1 time, last 5 s ago; used anyway: no other node fits"
    )
    assert [span(s) for s in (0.4, 119.0, 180.0, 9000.0)] == ["0 s", "119 s", "3 min", "2.5 h"]


def test_the_filter_refuses_only_avoided_nodes() -> None:
    check = f.AvoidFailedNodes()
    view = placement_node(gpu_node("n1", seen_at=NOW), NOW)
    request = f.Request.for_spec(model("m"))
    assert check.check(view, request) is None
    assert check.check(view, replace(request, avoid=frozenset({"n2"}))) is None
    rejection = check.check(view, replace(request, avoid=frozenset({"n1"})))
    assert rejection is not None
    assert (rejection.reason, rejection.dimension) == (f.FAILED_HERE, "node")
    assert replace(request, avoid=frozenset({"n1"})).relaxed() == request


def test_placement_skips_an_avoided_node_even_when_it_holds_the_weights() -> None:
    snapshot = build_snapshot(
        fleet([gpu_node("a", seen_at=NOW, weights=["m"]), gpu_node("b", seen_at=NOW)], []), NOW
    )
    request = f.Request.for_spec(model("m"))
    plain = Placer().place(snapshot, request)
    assert isinstance(plain, Placement) and plain.shards[0].node == "a"
    avoiding = Placer().place(snapshot, replace(request, avoid=frozenset({"a"})))
    assert isinstance(avoiding, Placement) and avoiding.shards[0].node == "b"


def test_placement_falls_back_to_an_avoided_node_when_nothing_else_fits() -> None:
    snapshot = build_snapshot(
        fleet([gpu_node("a", gpus=1, seen_at=NOW), gpu_node("b", gpus=1, seen_at=NOW)], []), NOW
    )
    snapshot.allocate("b", [0], "other")
    request = replace(f.Request.for_spec(model("m")), avoid=frozenset({"a"}))
    result = Placer().place(snapshot, request)
    assert isinstance(result, Placement) and result.shards[0].node == "a"
    # When even that fails, the reason is the plain one: avoidance is never
    # why a model cannot be placed.
    snapshot.allocate("a", [0], "other")
    refused = Placer().place(snapshot, request)
    assert isinstance(refused, Unplaceable)
    assert refused.reason == (
        "needs 1 free h100-80g on one node; 0/2 nodes fit: 2 too few free h100-80g"
        " (at most 0 free)"
    )


def test_a_multi_node_replica_avoids_its_failed_nodes_too() -> None:
    nodes = [gpu_node(n, seen_at=NOW, weights=["big"] if n in "ab" else []) for n in "abcd"]
    snapshot = build_snapshot(fleet(nodes, []), NOW)
    request = f.Request.for_spec(model("big", gpus=16, nodes=2))
    first = Placer().place(snapshot, request)
    assert isinstance(first, Placement) and {s.node for s in first.shards} == {"a", "b"}
    avoiding = Placer().place(snapshot, replace(request, avoid=frozenset({"a", "b"})))
    assert isinstance(avoiding, Placement) and {s.node for s in avoiding.shards} == {"c", "d"}


# -- whole passes (decide) -------------------------------------------------------


def failed_on(state: FleetState, node: str, model_name: str, at: float, rid: str) -> None:
    state.replicas[rid] = ReplicaRecord(
        id=rid,
        model=model_name,
        created_at=at,
        shards=[ShardAssignment(node=node, device_numbers=[0], device_uuids=[f"GPU-{node}-0"])],
        state=ReplicaState.FAILED,
        reason="CUDA error: unknown error",
    )


def test_a_failure_is_counted_on_its_node_and_the_next_placement_goes_elsewhere() -> None:
    nodes = [gpu_node("a", seen_at=NOW, weights=["m"]), gpu_node("b", seen_at=NOW)]
    state = fleet(nodes, [model("m")], NOW)
    failed_on(state, "a", "m", NOW - 10, "r1")
    decisions = decide(state, NOW, Policy(backoff_base_s=0.0))
    update = decisions.models["m"]
    assert update.node_failures == {"a": NodeFailure(1, NOW)}
    assert state.models["m"].node_failures == {}  # decide changed nothing
    (new,) = decisions.new
    assert new.nodes == ["b"]
    placed = next(e for e in decisions.events if e.kind == "placed")
    assert placed.message.endswith("; avoided a after failures there")
    failed = next(e for e in decisions.events if e.kind == "failed")
    assert failed.message.endswith(
        ": CUDA error: unknown error (failure 1 of 5; 1 on a, avoided there for 60 s)"
    )


def test_after_the_node_backoff_the_node_holding_the_weights_is_used_again() -> None:
    nodes = [gpu_node("a", seen_at=NOW + 61, weights=["m"]), gpu_node("b", seen_at=NOW + 61)]
    state = fleet(nodes, [model("m")], NOW)
    state.models["m"].node_failures = {"a": NodeFailure(1, NOW, current_run=False)}
    assert [r.nodes for r in decide(state, NOW + 59).new] == [["b"]]
    assert [r.nodes for r in decide(state, NOW + 61).new] == [["a"]]


def test_a_ready_start_on_the_node_clears_its_failures() -> None:
    state = fleet([gpu_node("a", seen_at=NOW)], [model("m")], NOW)
    state.models["m"].node_failures = {"a": NodeFailure(2, NOW - 100, current_run=False)}
    failed_on(state, "a", "m", NOW - 50, "r1")
    state.replicas["r1"].state = ReplicaState.READY
    decisions = decide(state, NOW)
    assert decisions.models["m"].node_failures == {}


def test_failures_on_nodes_that_left_the_fleet_are_forgotten() -> None:
    state = fleet([gpu_node("a", seen_at=NOW)], [model("m", min_replicas=0)], NOW)
    state.models["m"].node_failures = {"gone": NodeFailure(1, NOW - 10)}
    assert decide(state, NOW).models["m"].node_failures == {}


def test_failing_on_one_node_while_another_node_serves_it_does_not_park() -> None:
    # Two one-card nodes, two replicas: b's has served all along, a fails
    # every start. a is the only free place, so it is retried there.
    state = fleet(
        [gpu_node("a", gpus=1, seen_at=NOW), gpu_node("b", gpus=1, seen_at=NOW)],
        [model("m", min_replicas=2)],
        NOW,
    )
    failed_on(state, "b", "m", NOW - 500, "good")
    state.replicas["good"].state = ReplicaState.READY
    policy = Policy(backoff_base_s=0.0, failure_limit=3)
    _, now = fail_starts(state, policy, 8, NOW)
    record = state.models["m"]
    assert record.failures >= 6 and not record.parked
    assert set(record.node_failures) == {"a"}
    # The plan says why it keeps trying: the retry on a fails again.
    (retry,) = [r for r in state.replicas.values() if r.state is ReplicaState.STARTING]
    assert retry.nodes == ["a"]
    retry.state = ReplicaState.FAILED
    (planned,) = plan(state, now, policy=replace(policy, backoff_base_s=10.0)).models
    assert planned.status == BACKING_OFF
    assert planned.reason is not None and planned.reason.endswith(
        "; not parked: it failed on 1 node (a) only, and other nodes can take it"
    )


def test_failing_on_every_node_parks_as_before() -> None:
    state = fleet(
        [gpu_node(n, gpus=1, seen_at=NOW) for n in "abc"], [model("m")], NOW
    )
    policy = Policy(backoff_base_s=0.0, failure_limit=3)
    fail_starts(state, policy, 4, NOW)
    record = state.models["m"]
    assert record.parked and record.failures == 3
    # Each retry went to a node it had not failed on yet.
    assert sorted(record.node_failures) == ["a", "b", "c"]


def test_the_only_node_that_can_hold_the_model_parks_it_alone() -> None:
    # b has the wrong class: a is the only node that fits.
    nodes = [gpu_node("a", gpus=1, seen_at=NOW), gpu_node("b", gpu_class="l4-24g", seen_at=NOW)]
    state = fleet(nodes, [model("m")], NOW)
    policy = Policy(backoff_base_s=0.0, failure_limit=3)
    fail_starts(state, policy, 4, NOW)
    record = state.models["m"]
    assert record.parked and record.failures == 3 and list(record.node_failures) == ["a"]
    (planned,) = plan(state, NOW + 10, policy=policy).models
    assert planned.status == PARKED


def test_the_plan_names_the_avoided_node() -> None:
    nodes = [gpu_node("n3", seen_at=NOW, weights=["m"]), gpu_node("n4", seen_at=NOW)]
    state = fleet(nodes, [model("m")], NOW)
    state.models["m"].node_failures = {"n3": NodeFailure(3, NOW - 40.0, current_run=False)}
    (planned,) = plan(state, NOW).models
    assert planned.avoided == [
        "n3: model m failed there 3 times, last 40 s ago; avoided for 3 min"
    ]
    assert [r.nodes for r in planned.replicas if r.action == "place"] == [["n4"]]
    # Nothing else fits: used anyway, and the plan says so.
    state.nodes["n4"].admin_state = state.nodes["n4"].admin_state.CORDONED
    (planned,) = plan(state, NOW).models
    assert planned.avoided == [
        "n3: model m failed there 3 times, last 40 s ago; used anyway: no other node fits"
    ]
    assert [r.nodes for r in planned.replicas if r.action == "place"] == [["n3"]]
