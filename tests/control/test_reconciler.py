"""The reconciler against a real SQLite store: lifecycles over several passes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.control.reconciler import Reconciler, unpark
from llmgw.control.rows import model_from_row, model_row
from llmgw.control.scheduler.decisions import Policy
from llmgw.control.scheduler.planner import plan
from llmgw.control.state import FleetState, ModelRecord, NodeFailure, NodeRecord, ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.errors import NotFoundError, NotLeaderError
from llmgw.sim.fleetgen import fleet, gpu_node, model
from llmgw.wire import ModelSpec, NodeState, ReplicaState

T0 = 1_000_000.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open("sqlite:///" + str(tmp_path / "t.db"))
    yield opened
    await opened.close()


def one_gpu_nodes(*names: str, seen_at: float = T0, gpus: int = 1) -> list[NodeRecord]:
    return [gpu_node(n, gpus=gpus, seen_at=seen_at) for n in names]


def only(state: FleetState, model_name: str | None = None) -> ReplicaRecord:
    found = [r for r in state.replicas.values() if model_name in (None, r.model)]
    assert len(found) == 1, found
    return found[0]


def ready(replica: ReplicaRecord, at: float) -> None:
    replica.state = ReplicaState.READY
    replica.ready_at = at


def touch(state: FleetState, at: float) -> None:
    """Every node reports at ``at`` (keeps them reachable)."""
    for node in state.nodes.values():
        node.last_seen = at


async def first_pass(
    store: Store, nodes: list[NodeRecord], specs: list[ModelSpec], policy: Policy | None = None
) -> tuple[FleetState, Reconciler, int]:
    """A fleet of ``nodes`` and ``specs`` after the reconciler's first pass at T0."""
    epoch = await store.bump_epoch()
    state = fleet(nodes, specs, T0)
    reconciler = Reconciler(state, store, policy=policy)
    await reconciler.run_pass(T0, epoch)
    return state, reconciler, epoch


async def kinds(store: Store) -> list[str]:
    return [row["kind"] for row in reversed(await store.list_events(limit=1000))]


async def test_a_pass_places_writes_rows_and_events_and_bumps_routing(store: Store) -> None:
    epoch = await store.bump_epoch()
    state = fleet(one_gpu_nodes("a", "b", gpus=8), [model("m", gpus=2, min_replicas=2)], T0)
    result = await Reconciler(state, store).run_pass(T0, epoch)
    assert (result.placed, result.removed) == (2, 0)
    assert state.routing_version == 1
    rows = {row["id"]: row for row in await store.list_replicas()}
    assert set(rows) == set(state.replicas)
    for replica in state.replicas.values():
        row = rows[replica.id]
        assert row["state"] == "starting" and row["epoch"] == epoch and row["model"] == "m"
        assert row["shards"] == [s.model_dump() for s in replica.shards]
        assert replica.shards[0].device_uuids[0].startswith("GPU-")
    assert {r.nodes[0] for r in state.replicas.values()} == {"a", "b"}  # spread
    assert await kinds(store) == ["placed", "placed"]
    # Steady state: nothing to do, nothing written, routing not bumped.
    again = await Reconciler(state, store).run_pass(T0 + 1, epoch)
    assert not again.changed and state.routing_version == 1


async def test_a_stale_epoch_changes_neither_store_nor_memory(store: Store) -> None:
    epoch = await store.bump_epoch()
    await store.bump_epoch()  # another instance took over
    state = fleet(one_gpu_nodes("a"), [model("m")], T0)
    with pytest.raises(NotLeaderError):
        await Reconciler(state, store).run_pass(T0, epoch)
    assert state.replicas == {} and await store.list_replicas() == []
    assert state.routing_version == 0


async def test_failures_back_off_exponentially_then_park_and_unpark(store: Store) -> None:
    epoch = await store.bump_epoch()
    state = fleet(one_gpu_nodes("a"), [model("m")], T0)
    reconciler = Reconciler(state, store, policy=Policy(failure_limit=3, backoff_base_s=10.0))
    now = T0
    await reconciler.run_pass(now, epoch)
    retried_at = []
    for attempt in range(1, 4):
        replica = only(state)
        replica.state, replica.reason = ReplicaState.FAILED, f"exit code 1 (try {attempt})"
        now += 1
        touch(state, now)
        result = await reconciler.run_pass(now, epoch)
        assert result.failed == 1 and state.replicas == {}
        record = state.models["m"]
        assert record.failures == attempt
        if attempt == 3:
            break
        # Backoff: 10 s after the first failure, 20 s after the second.
        wait = 10.0 * 2 ** (attempt - 1)
        touch(state, now + wait - 1)
        assert (await reconciler.run_pass(now + wait - 1, epoch)).placed == 0
        (planned,) = plan(state, now + wait - 1, policy=reconciler.scheduler.policy).models
        assert planned.status == "backing off"
        assert planned.reason == (
            f"retrying after {attempt} failed start{'s' if attempt > 1 else ''} in 1 s;"
            f" last error: exit code 1 (try {attempt})"
        )
        now += wait
        touch(state, now)
        assert (await reconciler.run_pass(now, epoch)).placed == 1
        retried_at.append(now)
    record = state.models["m"]
    assert record.parked and record.last_error == "exit code 1 (try 3)"
    (row,) = await store.list_models()
    assert (row["parked"], row["failures"], row["last_error"]) == (True, 3, "exit code 1 (try 3)")
    assert (await kinds(store)).count("failed") == 3 and "parked" in await kinds(store)
    # Parked: never retried, however long we wait.
    touch(state, now + 10_000)
    assert (await reconciler.run_pass(now + 10_000, epoch)).placed == 0
    assert list(record.node_failures) == ["a"]
    unparked = unpark(state, "m")
    assert (unparked.parked, unparked.failures, unparked.node_failures) == (False, 0, {})
    await store.upsert_models([model_row(unparked)], epoch=epoch)
    assert (await reconciler.run_pass(now + 10_001, epoch)).placed == 1
    with pytest.raises(NotFoundError):
        unpark(state, "nope")


def fail_all_starting(state: FleetState, reason: str = "CUDA error: unknown error") -> None:
    for replica in state.replicas.values():
        if replica.state is ReplicaState.STARTING:
            replica.state, replica.reason = ReplicaState.FAILED, reason


async def test_a_model_that_failed_on_a_node_is_next_placed_on_another(store: Store) -> None:
    epoch = await store.bump_epoch()
    nodes = [gpu_node("a", gpus=1, seen_at=T0, weights=["m"]), gpu_node("b", gpus=1, seen_at=T0)]
    state = fleet(nodes, [model("m")], T0)
    reconciler = Reconciler(state, store, policy=Policy(backoff_base_s=5.0))
    await reconciler.run_pass(T0, epoch)
    assert only(state).nodes == ["a"]  # it holds the weights
    fail_all_starting(state)
    touch(state, T0 + 10)
    await reconciler.run_pass(T0 + 10, epoch)
    assert state.models["m"].node_failures == {"a": NodeFailure(1, T0 + 10)}
    touch(state, T0 + 16)
    assert (await reconciler.run_pass(T0 + 16, epoch)).placed == 1
    assert only(state).nodes == ["b"]
    # Persisted with the model: a new leader still knows to avoid a.
    (row,) = await store.list_models()
    assert row["node_failures"] == {"a": {"failures": 1, "last_at": T0 + 10, "current_run": True}}
    assert model_from_row(row).node_failures == state.models["m"].node_failures
    # b serves: the run of failures is over (a stays avoided until its
    # backoff ends, and b's success says nothing about a).
    ready(only(state), T0 + 20)
    touch(state, T0 + 21)
    await reconciler.run_pass(T0 + 21, epoch)
    record = state.models["m"]
    assert record.failures == 0
    assert record.node_failures == {"a": NodeFailure(1, T0 + 10, current_run=False)}


async def test_with_one_node_a_failed_model_is_retried_there_after_its_backoff(
    store: Store,
) -> None:
    epoch = await store.bump_epoch()
    state = fleet(one_gpu_nodes("a"), [model("m")], T0)
    # The model's backoff (10 s) is far shorter than the node's (60 s): with
    # nowhere else to go, the model's own backoff decides.
    reconciler = Reconciler(state, store, policy=Policy(backoff_base_s=10.0))
    await reconciler.run_pass(T0, epoch)
    fail_all_starting(state)
    await reconciler.run_pass(T0 + 1, epoch)
    touch(state, T0 + 10)
    assert (await reconciler.run_pass(T0 + 10, epoch)).placed == 0
    touch(state, T0 + 11)
    assert (await reconciler.run_pass(T0 + 11, epoch)).placed == 1
    assert only(state).nodes == ["a"]
    placed = (await store.list_events(kind="placed", limit=1))[0]["message"]
    assert placed.endswith(", although m failed there recently: no other node fits")


async def test_a_model_failing_on_one_node_is_not_parked_while_others_serve_it(
    store: Store,
) -> None:
    epoch = await store.bump_epoch()
    # Three one-card nodes, a broken; two replicas wanted.
    nodes = [gpu_node(n, gpus=1, seen_at=T0, weights=["m"] if n == "a" else []) for n in "abc"]
    state = fleet(nodes, [model("m", min_replicas=2)], T0)
    reconciler = Reconciler(state, store, policy=Policy(failure_limit=3, backoff_base_s=1.0))
    now = T0
    await reconciler.run_pass(now, epoch)
    for step in range(6):
        # Whatever starts on a fails; elsewhere it comes up.
        for replica in list(state.replicas.values()):
            if replica.state is ReplicaState.STARTING:
                if replica.nodes == ["a"]:
                    replica.state, replica.reason = ReplicaState.FAILED, "Xid 79: GPU fell off"
                else:
                    ready(replica, now + 0.5)
        now += 2.0 ** step + 1
        touch(state, now)
        await reconciler.run_pass(now, epoch)
    record = state.models["m"]
    assert not record.parked and record.failures == 0
    assert sorted(r.nodes[0] for r in state.replicas.values()) == ["b", "c"]
    assert all(r.state is ReplicaState.READY for r in state.replicas.values())
    assert list(record.node_failures) == ["a"] and "parked" not in await kinds(store)


async def test_a_model_failing_on_every_node_is_parked_as_before(store: Store) -> None:
    epoch = await store.bump_epoch()
    state = fleet(one_gpu_nodes("a", "b", "c", "d"), [model("m")], T0)
    reconciler = Reconciler(state, store, policy=Policy(failure_limit=3, backoff_base_s=1.0))
    now = T0
    await reconciler.run_pass(now, epoch)
    tried = []
    while not state.models["m"].parked:
        assert len(tried) < 10
        tried.append(only(state).nodes[0])
        fail_all_starting(state, "exit code 1")
        now += 10
        touch(state, now)
        await reconciler.run_pass(now, epoch)  # counts the failure
        now += 10
        touch(state, now)
        await reconciler.run_pass(now, epoch)  # retries, unless parked
    assert len(tried) == 3 and len(set(tried)) == 3  # never the same node twice
    (parked,) = await store.list_events(kind="parked")
    assert parked["message"] == (
        f"m parked after 3 consecutive failed starts on 3 nodes ({', '.join(sorted(tried))});"
        " last error: exit code 1"
    )


async def test_a_replica_that_becomes_ready_resets_the_failure_count(store: Store) -> None:
    state, reconciler, epoch = await first_pass(
        store, one_gpu_nodes("a"), [model("m")], Policy(backoff_base_s=1.0)
    )
    only(state).state = ReplicaState.FAILED
    await reconciler.run_pass(T0 + 1, epoch)
    assert state.models["m"].failures == 1
    touch(state, T0 + 5)
    await reconciler.run_pass(T0 + 5, epoch)
    ready(only(state), T0 + 6)
    await reconciler.run_pass(T0 + 7, epoch)
    assert state.models["m"].failures == 0
    (row,) = await store.list_models()
    assert row["failures"] == 0


async def test_a_start_that_times_out_counts_as_a_failure(store: Store) -> None:
    epoch = await store.bump_epoch()
    spec = model("m")
    spec.start_timeout_s = 60.0
    state = fleet(one_gpu_nodes("a"), [spec], T0)
    reconciler = Reconciler(state, store)
    await reconciler.run_pass(T0, epoch)
    touch(state, T0 + 61)
    result = await reconciler.run_pass(T0 + 61, epoch)
    assert result.failed == 1
    assert state.models["m"].last_error == "not ready within its start timeout of 60 s"


async def test_on_demand_scales_from_zero_and_unloads_when_idle(store: Store) -> None:
    epoch = await store.bump_epoch()
    spec = model("lazy", min_replicas=0, max_replicas=1, idle_timeout_s=300.0)
    state = fleet(one_gpu_nodes("a"), [spec], T0)
    reconciler = Reconciler(state, store)
    assert (await reconciler.run_pass(T0, epoch)).placed == 0
    state.models["lazy"].demand_at = T0 + 1  # a request asked for it
    assert (await reconciler.run_pass(T0 + 1, epoch)).placed == 1
    replica = only(state)
    ready(replica, T0 + 10)
    replica.last_request_at = T0 + 200
    touch(state, T0 + 400)
    # Asked for 399 s ago, but used 200 s ago: still in use.
    assert (await reconciler.run_pass(T0 + 400, epoch)).removed == 0
    touch(state, T0 + 501)
    result = await reconciler.run_pass(T0 + 501, epoch)
    assert result.removed == 1 and state.replicas == {}
    assert (await kinds(store))[-1] == "unloaded"
    assert await store.list_replicas() == []


async def test_idle_on_demand_replicas_are_evicted_longest_idle_first(store: Store) -> None:
    epoch = await store.bump_epoch()
    specs = [
        model("old", min_replicas=0, max_replicas=1),
        model("recent", min_replicas=0, max_replicas=1),
        model("fresh", min_replicas=0, max_replicas=1),
    ]
    state = fleet(one_gpu_nodes("a", gpus=3), specs, T0)
    reconciler = Reconciler(state, store, policy=Policy(evict_min_idle_s=60.0))
    for name in ("old", "recent", "fresh"):
        state.models[name].demand_at = T0
    await reconciler.run_pass(T0, epoch)
    last_used = {"old": T0 + 10, "recent": T0 + 200, "fresh": T0 + 290}
    for replica in state.replicas.values():
        ready(replica, T0 + 5)
        replica.last_request_at = last_used[replica.model]
    state.models["new"] = ModelRecord(
        spec=model("new", min_replicas=1), created_at=T0, updated_at=T0
    )
    touch(state, T0 + 300)
    result = await reconciler.run_pass(T0 + 300, epoch)
    assert (result.evicted, result.placed) == (1, 1)
    assert {r.model for r in state.replicas.values()} == {"recent", "fresh", "new"}
    assert "evicted" in await kinds(store)
    # "fresh" (idle 10 s) is never evicted: below the minimum idle time.
    state.models["other"] = ModelRecord(
        spec=model("other", min_replicas=1), created_at=T0, updated_at=T0
    )
    state.replicas[only(state, "new").id].state = ReplicaState.READY
    state.replicas[only(state, "recent").id].last_request_at = T0 + 299
    result = await reconciler.run_pass(T0 + 301, epoch)
    assert (result.evicted, result.placed) == (0, 0)
    reason = state.models["other"].unplaceable_reason
    assert reason == (
        "needs 1 free h100-80g on one node; 0/1 nodes fit: 1 too few free h100-80g (at most 0 free)"
    )


async def test_draining_node_moves_replicas_make_before_break(store: Store) -> None:
    state, reconciler, epoch = await first_pass(
        store, one_gpu_nodes("a", "b"), [model("m")], Policy(drain_grace_s=5.0)
    )
    old = only(state)
    ready(old, T0 + 1)
    state.nodes[old.nodes[0]].admin_state = NodeState.DRAINING
    touch(state, T0 + 2)
    result = await reconciler.run_pass(T0 + 2, epoch)
    assert result.placed == 1 and result.draining == 0
    new = next(r for r in state.replicas.values() if r.id != old.id)
    assert new.nodes != old.nodes and not old.draining
    # The new one is still starting: the old one keeps serving.
    assert not (await reconciler.run_pass(T0 + 3, epoch)).changed
    ready(new, T0 + 4)
    result = await reconciler.run_pass(T0 + 4, epoch)
    assert result.draining == 1 and old.draining
    assert {r["id"]: r["draining"] for r in await store.list_replicas()}[old.id] is True
    old.in_flight = 2
    touch(state, T0 + 20)
    assert (await reconciler.run_pass(T0 + 20, epoch)).removed == 0  # requests in flight
    old.in_flight = 0
    result = await reconciler.run_pass(T0 + 21, epoch)
    assert result.removed == 1 and set(state.replicas) == {new.id}
    drains = [
        (row["data"]["step"], row["data"]["replica"])
        for row in reversed(await store.list_events(kind="drain"))
    ]
    assert drains == [("draining", old.id), ("removed", old.id)]


async def test_a_drain_with_nowhere_to_go_keeps_the_old_replica(store: Store) -> None:
    state, reconciler, epoch = await first_pass(store, one_gpu_nodes("a"), [model("m")])
    ready(only(state), T0)
    state.nodes["a"].admin_state = NodeState.DRAINING
    result = await reconciler.run_pass(T0 + 1, epoch)
    assert (result.placed, result.removed, result.draining) == (0, 0, 0)
    assert state.models["m"].unplaceable_reason == (
        "needs 1 free h100-80g on one node; 0/1 nodes fit: 1 draining"
    )


async def test_replicas_on_nodes_unreachable_past_the_grace_are_replaced(store: Store) -> None:
    # The model keeps a routable replica elsewhere: the lost one is waited
    # for (its node may come back with a warm cache), then replaced.
    state, reconciler, epoch = await first_pass(
        store,
        one_gpu_nodes("a", "b", "c"),
        [model("m", min_replicas=2)],
        Policy(replace_after_s=120.0),
    )
    for replica in state.replicas.values():
        ready(replica, T0)
    lost = min(state.replicas.values(), key=lambda r: r.id)
    for name, node in state.nodes.items():
        if name not in lost.nodes:
            node.last_seen = T0 + 60
    # Unreachable (no report for 60 s) but within the grace: kept.
    assert not (await reconciler.run_pass(T0 + 60, epoch)).changed
    touch(state, T0 + 121)
    state.nodes[lost.nodes[0]].last_seen = T0
    result = await reconciler.run_pass(T0 + 121, epoch)
    assert (result.removed, result.placed) == (1, 1)
    assert lost.id not in state.replicas
    assert lost.nodes[0] not in {n for r in state.replicas.values() for n in r.nodes}
    assert "replaced" in await kinds(store)


async def test_a_model_left_with_no_routable_replica_is_replaced_at_once(store: Store) -> None:
    state, reconciler, epoch = await first_pass(
        store, one_gpu_nodes("a", "b"), [model("m")], Policy(replace_after_s=120.0)
    )
    lost = only(state)
    ready(lost, T0)
    survivor = "b" if lost.nodes == ["a"] else "a"
    # Within the unreachable grace (30 s): nothing is known yet.
    state.nodes[survivor].last_seen = T0 + 20
    assert not (await reconciler.run_pass(T0 + 20, epoch)).changed
    # Unreachable, long before the 120 s replacement grace: a replacement
    # starts now, and the lost replica stays until it is ready (its node may
    # still come back first).
    state.nodes[survivor].last_seen = T0 + 40
    result = await reconciler.run_pass(T0 + 40, epoch)
    assert (result.placed, result.removed) == (1, 0)
    replacement = next(r for r in state.replicas.values() if r.id != lost.id)
    assert replacement.nodes == [survivor]
    # Still starting: no second replacement, the lost one kept.
    state.nodes[survivor].last_seen = T0 + 45
    assert not (await reconciler.run_pass(T0 + 45, epoch)).changed
    ready(replacement, T0 + 46)
    state.nodes[survivor].last_seen = T0 + 50
    result = await reconciler.run_pass(T0 + 50, epoch)
    assert (result.placed, result.removed) == (0, 1)
    assert only(state) is replacement


async def test_with_nowhere_to_go_a_stranded_replica_is_kept(store: Store) -> None:
    state, reconciler, epoch = await first_pass(
        store, one_gpu_nodes("a"), [model("m")], Policy(replace_after_s=120.0)
    )
    lost = only(state)
    ready(lost, T0)
    result = await reconciler.run_pass(T0 + 40, epoch)
    assert (result.placed, result.removed) == (0, 0)
    assert only(state) is lost


async def test_extras_are_removed_idle_first(store: Store) -> None:
    epoch = await store.bump_epoch()
    state = fleet(one_gpu_nodes("a", "b", "c"), [model("m", min_replicas=1, max_replicas=3)], T0)
    state.models["m"].load_demand = 2
    reconciler = Reconciler(state, store)
    assert (await reconciler.run_pass(T0, epoch)).placed == 3
    used = iter([T0 + 50, T0 + 10, T0 + 90])
    for replica in sorted(state.replicas.values(), key=lambda r: r.id):
        ready(replica, T0 + 1)
        replica.last_request_at = next(used)
    busiest = max(state.replicas.values(), key=lambda r: r.last_request_at or 0)
    state.models["m"].load_demand = 0
    touch(state, T0 + 100)
    result = await reconciler.run_pass(T0 + 100, epoch)
    assert result.removed == 2 and set(state.replicas) == {busiest.id}


async def test_replicas_of_a_deleted_model_are_removed(store: Store) -> None:
    state, reconciler, epoch = await first_pass(store, one_gpu_nodes("a"), [model("m")])
    del state.models["m"]
    result = await reconciler.run_pass(T0 + 1, epoch)
    assert result.removed == 1 and state.replicas == {}


async def test_a_changed_shape_is_replaced_make_before_break(store: Store) -> None:
    state, reconciler, epoch = await first_pass(store, one_gpu_nodes("a", gpus=8), [model("m")])
    old = only(state)
    ready(old, T0)
    state.models["m"].spec = model("m", gpus=2)
    result = await reconciler.run_pass(T0 + 1, epoch)
    assert result.placed == 1 and not old.draining
    new = next(r for r in state.replicas.values() if r.id != old.id)
    assert len(new.shards[0].device_numbers) == 2
    ready(new, T0 + 2)
    assert (await reconciler.run_pass(T0 + 2, epoch)).draining == 1


async def test_the_unplaceable_event_is_written_once_per_reason(store: Store) -> None:
    epoch = await store.bump_epoch()
    spec: ModelSpec = model("huge", gpus=8)
    state = fleet(one_gpu_nodes("a", gpus=4), [spec], T0)
    reconciler = Reconciler(state, store)
    for step in range(3):
        result = await reconciler.run_pass(T0 + step, epoch)
        assert result.unplaceable == 1
    events = await store.list_events(kind="unplaceable")
    assert len(events) == 1
    assert events[0]["message"] == (
        "huge: can never fit: needs 8 h100-80g on one node; no node has that many"
        " (the largest has 4)"
    )
