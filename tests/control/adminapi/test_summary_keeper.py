"""The kept summary is the summary built from scratch, whatever changed and whenever.

Random fleets change between calls the way the control plane changes them
(fields assigned, inventories and lists replaced, records added, removed or
replaced) while the clock moves, sometimes past the unreachable grace or the
idle threshold; after each change the keeper's answer must equal
``fleet_summary``'s.

The keeper reads only the records whose fields were assigned since its last
call (writelog.py), so the changes include the ways around that log: a
record built before a call and put in the fleet after it (its fields were
written before the keeper last read), writes to a same-named record of
another fleet, and a keeper that fell behind a log that dropped writes.
"""

from __future__ import annotations

import dataclasses

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.control.adminapi.fleetkit import Fleet, gpu, gpus, mig

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, fleet_summary
from llmgw.control.adminapi.summary_keeper import SummaryKeeper
from llmgw.control.nodetable import NodeTable
from llmgw.control.replicatable import ReplicaTable
from llmgw.control.writelog import WriteLog
from llmgw.wire import NodeInventory, NodeState, ReplicaState, WeightsEntry

MODELS = ["a", "b", "c"]
STORE = StoreStatus(members=[])


def start() -> Fleet:
    fleet = Fleet()
    fleet.node("n1", gpus(4), weights=("a",))
    fleet.node("n2", [gpu(0, healthy=False), *gpus(4)[1:]], fabrics=("ib-b",), weights=("b",))
    fleet.node("n3", [mig(0, 0), mig(0, 1), gpu(1, "a100-80g")], fabrics=("ib-a", "ib-b"))
    fleet.model("a", max_replicas=3)
    # Asked for 20 s before its idle timeout runs out: the clock alone changes it.
    fleet.model(
        "b", min_replicas=0, max_replicas=2, idle_timeout_s=900.0, demand_at=fleet.now - 880
    )
    fleet.model("c", parked=True, failures=5, last_error="engine exited (1)")
    fleet.replica("a", "n1", [0, 1], idle=3600)
    fleet.replica("b", "n2", [1], state=ReplicaState.STARTING)
    return fleet


CHANGES = [
    "add",
    "add",
    "remove",
    "replace-record",
    "state",
    "in-flight",
    "used",
    "cordon",
    "silence",
    "report",
    "inventory",
    "weights",
    "fabrics",
    "new-node",
    "drop-node",
    "park",
    "unplaceable",
    "demand",
    "new-model",
    "drop-model",
    "clock",
    "clock",
    "idle-clock",
    "stash",
    "swap-in",
    "other-fleet",
    "fell-behind",
    "move-to",
    "restart",
    "new-table",
    "new-node-table",
    "plain-nodes",
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(CHANGES), st.integers(0, 10_000)), max_size=30))
def test_the_kept_summary_is_the_built_one(steps: list[tuple[str, int]]) -> None:
    fleet = start()
    state = fleet.state
    keeper = SummaryKeeper()
    now = fleet.now
    assert keeper.summary(state, now, STORE) == fleet_summary(state, now, STORE)
    other = start().state  # the same names, another fleet
    stashed: list[object] = []  # records built before a call, put in after it
    for kind, roll in steps:
        nodes = sorted(state.nodes)
        node = state.nodes[nodes[roll % len(nodes)]] if nodes else None
        rids = sorted(state.replicas)
        replica = state.replicas[rids[roll % len(rids)]] if rids else None
        models = sorted(state.models)
        if kind == "add" and node is not None and node.inventory is not None and models:
            numbers = [d.number for d in node.inventory.devices][roll % 2 :][: 1 + roll % 2]
            fleet.replica(
                models[roll % len(models)],
                node.name,
                numbers,
                state=[ReplicaState.READY, ReplicaState.STARTING][roll % 2],
                idle=[5.0, 900.0, None][roll % 3],
            )
        elif kind == "remove" and replica is not None:
            del state.replicas[replica.id]
        elif kind == "replace-record" and replica is not None:
            shard = replica.shards[0]
            fleet.replica(replica.model, shard.node, list(shard.device_numbers))
            new = state.replicas.pop(f"r{fleet._ids:04d}")
            new.id = replica.id
            state.replicas[replica.id] = new
        elif kind == "state" and replica is not None:
            replica.state = [
                ReplicaState.READY,
                ReplicaState.FAILED,
                ReplicaState.DRAINING,
                ReplicaState.STARTING,
            ][roll % 4]
            replica.ready_at = now - roll % 2000 if replica.state is ReplicaState.READY else None
        elif kind == "in-flight" and replica is not None:
            replica.in_flight = roll % 3
        elif kind == "used" and replica is not None:
            replica.last_request_at = now - roll % 1500
        elif kind == "cordon" and node is not None:
            node.admin_state = [NodeState.READY, NodeState.CORDONED, NodeState.DRAINING][roll % 3]
        elif kind == "silence" and node is not None:
            node.last_seen = now - 3600
        elif kind == "report" and node is not None:
            node.last_seen = now
        elif kind == "inventory" and node is not None and node.inventory is not None:
            devices = [d.model_copy() for d in node.inventory.devices]
            devices[roll % len(devices)] = devices[roll % len(devices)].model_copy(
                update={"healthy": not devices[roll % len(devices)].healthy}
            )
            node.inventory = NodeInventory(hostname=node.name, source="fake", devices=devices)
        elif kind == "weights" and node is not None:
            node.weights = [WeightsEntry(model=m) for m in MODELS if (roll >> MODELS.index(m)) & 1]
        elif kind == "fabrics" and node is not None:
            node.fabrics = [["ib-a"], ["ib-b"], [], ["ib-a", "ib-c"]][roll % 4]
        elif kind == "new-node":
            fleet.node(f"x{roll}", gpus(1 + roll % 3), seen_ago=roll % 60)
        elif kind == "drop-node" and node is not None:
            del state.nodes[node.name]
        elif kind == "park" and models:
            record = state.models[models[roll % len(models)]]
            record.parked, record.failures = not record.parked, roll % 7
        elif kind == "unplaceable" and models:
            state.models[models[roll % len(models)]].unplaceable_reason = (
                None if roll % 2 else "needs 8 free h100-80g on one node"
            )
        elif kind == "demand" and models:
            state.models[models[roll % len(models)]].demand_at = now - roll % 1200
        elif kind == "new-model":
            fleet.model(f"m{roll}", min_replicas=roll % 2, max_replicas=2)
        elif kind == "drop-model" and models:
            del state.models[models[roll % len(models)]]
        elif kind == "clock":
            now += roll % 50
        elif kind == "idle-clock":
            now += IDLE_THRESHOLD_S - 30 + roll % 60
        elif kind == "stash" and node is not None and replica is not None:
            stashed.append(
                dataclasses.replace(
                    node,
                    admin_state=NodeState.CORDONED,
                    fabrics=["ib-z"],
                    last_seen=now - roll % 60,
                )
            )
            stashed.append(
                dataclasses.replace(
                    replica,
                    in_flight=1 + roll % 3,
                    state=[ReplicaState.READY, ReplicaState.FAILED][roll % 2],
                    ready_at=now - roll % 900,
                )
            )
        elif kind == "swap-in" and stashed:
            # Whole records in another's place, with no write since the last call.
            for record in stashed:
                if isinstance(record, type(node)) and record.name in state.nodes:
                    state.nodes[record.name] = record
                elif not isinstance(record, type(node)) and record.id in state.replicas:
                    state.replicas[record.id] = record
            stashed.clear()
        elif kind == "other-fleet":
            for twin in other.nodes.values():
                twin.admin_state, twin.last_seen = NodeState.DRAINING, now - roll % 100
            for twin_replica in other.replicas.values():
                twin_replica.in_flight = roll % 4
        elif kind == "fell-behind" and node is not None:
            node.last_seen = now - roll % 40
            keeper._node_writes = keeper._replica_writes = -1  # as if the log dropped these
        elif kind == "move-to" and replica is not None:
            target = [ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.FAILED][roll % 3]
            if replica.can_move_to(target):
                replica.move_to(target, reason=None if roll % 2 else "told to")
                if target is ReplicaState.READY:
                    replica.ready_at = now - roll % 1000
        elif (
            kind == "restart" and replica is not None and replica.can_move_to(ReplicaState.STARTING)
        ):
            replica.restart()
        elif kind == "new-node-table":
            # Likewise for the nodes' table.
            nodes_table = NodeTable(state.nodes)
            for record in stashed:
                if isinstance(record, type(node)) and record.name in nodes_table:
                    nodes_table[record.name] = record
            stashed.clear()
            nodes_table.version = getattr(state.nodes, "version", 0)
            state.nodes = nodes_table
        elif kind == "plain-nodes":
            state.nodes = dict(state.nodes)  # no write count: listed every call
        elif kind == "new-table":
            # Another table, whose write count matches the last one's, maybe
            # with a record built before the last call in another's place.
            table = ReplicaTable(state.replicas)
            for record in stashed:
                if not isinstance(record, type(node)) and record.id in table:
                    table[record.id] = record
            stashed.clear()
            table.version = state.replicas.version
            state.replicas = table
        built = fleet_summary(state, now, STORE)
        if roll % 2:
            assert keeper.summary(state, now, STORE) == built, kind
        else:  # the route's bytes
            assert orjson.loads(keeper.summary_json(state, now, STORE)) == built.model_dump(
                mode="json"
            ), kind


def test_a_clock_that_goes_back_starts_over() -> None:
    fleet = start()
    keeper = SummaryKeeper()
    later = keeper.summary(fleet.state, fleet.now + 4000, STORE)
    assert later.nodes.unreachable == 3
    assert keeper.summary(fleet.state, fleet.now, STORE) == fleet_summary(
        fleet.state, fleet.now, STORE
    )


def test_the_write_log_keeps_its_newest_half_and_says_when_a_reader_fell_behind() -> None:
    log: WriteLog[object] = WriteLog(limit=8)

    class Record:
        _writes: WriteLog[object]

        def __setattr__(self, name: str, value: object) -> None:
            object.__setattr__(self, name, value)
            self._writes.note(self)

    first, second = Record(), Record()
    log.adopt(first)
    log.adopt(second)
    start_at = log.position()
    first.x = 1
    second.x = 2
    first.x = 3
    assert log.since(start_at) == [first, second, first]
    assert log.since(log.position()) == []
    for value in range(6):  # past the limit: the older half goes
        second.x = value
    assert log.since(start_at) is None
    assert log.since(log.position() - 2) == [second, second]


def test_fleet_records_log_their_writes_in_their_own_tables() -> None:
    fleet, other = start(), start()
    node, replica = fleet.state.nodes["n1"], next(iter(fleet.state.replicas.values()))
    node_log, replica_log = fleet.state.nodes.writes, fleet.state.replicas.writes
    nodes_at, replicas_at = node_log.position(), replica_log.position()
    other_at = (other.state.nodes.writes.position(), other.state.replicas.writes.position())
    node.last_seen = fleet.now
    replica.in_flight = 2
    replica.move_to(ReplicaState.DRAINING)
    assert node_log.since(nodes_at) == [node]
    assert replica_log.since(replicas_at) == [replica, replica, replica]
    # Another fleet in the process hears nothing of it.
    assert (other.state.nodes.writes.position(),
            other.state.replicas.writes.position()) == other_at
    # A record put in another table logs there from then on.
    other.state.nodes["n1"] = node
    node.last_seen = fleet.now + 1
    assert node_log.since(nodes_at) == [node]
    assert other.state.nodes.writes.since(other_at[0]) == [node]


def test_tables_replaced_with_the_same_write_counts_are_read_again() -> None:
    fleet = start()
    state, now = fleet.state, fleet.now
    # n3 holds no replica: its view is not folded again for a replica's sake.
    node, replica = state.nodes["n3"], next(iter(state.replicas.values()))
    cordoned = dataclasses.replace(node, admin_state=NodeState.CORDONED)
    failed = dataclasses.replace(replica, state=ReplicaState.FAILED)
    keeper = SummaryKeeper()
    keeper.summary(state, now, STORE)  # after the records above were built
    nodes = NodeTable(state.nodes)
    nodes["n3"] = cordoned
    nodes.version = getattr(state.nodes, "version", 0)
    replicas = ReplicaTable(state.replicas)
    replicas[replica.id] = failed
    replicas.version = state.replicas.version
    state.nodes, state.replicas = nodes, replicas
    kept = keeper.summary(state, now, STORE)
    assert kept == fleet_summary(state, now, STORE)
    assert kept.nodes.cordoned == 1
