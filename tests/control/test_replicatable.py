"""The replica table's indexes agree with a scan after any sequence of dict writes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control.replicatable import ReplicaTable
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import ShardAssignment

MODELS = ["m1", "m2", "m3"]
NODES = ["n1", "n2", "n3", "n4"]


def replica(rid: str, model: str, nodes: list[str]) -> ReplicaRecord:
    return ReplicaRecord(
        id=rid, model=model, created_at=0.0,
        shards=[ShardAssignment(node=n, rank=i, device_numbers=[0]) for i, n in enumerate(nodes)],
    )


def check(table: ReplicaTable[ReplicaRecord]) -> None:
    # The same records; the order is the order they were indexed in.
    for model in MODELS:
        found = list(table.of_model(model))
        assert sorted(map(id, found)) == sorted(id(r) for r in table.values() if r.model == model)
        assert len(found) == len({r.id for r in found})
    for node in NODES:
        found = list(table.on_node(node))
        assert sorted(map(id, found)) == sorted(id(r) for r in table.values() if node in r.nodes)
        assert len(found) == len({r.id for r in found})


ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "pop", "popitem", "update", "setdefault", "clear", "ior"]),
        st.sampled_from(["r1", "r2", "r3", "r4", "r5"]),
        st.sampled_from(MODELS),
        st.lists(st.sampled_from(NODES), min_size=1, max_size=2, unique=True),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_indexes_follow_every_write(steps: list[tuple[str, str, str, list[str]]]) -> None:
    table: ReplicaTable[ReplicaRecord] = ReplicaTable()
    for op, rid, model, nodes in steps:
        record = replica(rid, model, nodes)
        if op == "set":
            table[rid] = record
        elif op == "del" and rid in table:
            del table[rid]
        elif op == "pop":
            table.pop(rid, None)
        elif op == "popitem" and table:
            table.popitem()
        elif op == "update":
            table.update({rid: record})
        elif op == "setdefault":
            table.setdefault(rid, record)
        elif op == "clear":
            table.clear()
        elif op == "ior":
            table |= {rid: record}
        check(table)


def test_fleet_state_takes_a_plain_dict_and_answers_from_the_indexes() -> None:
    a, b = replica("a", "m1", ["n1", "n2"]), replica("b", "m2", ["n2"])
    state = FleetState(replicas={"a": a, "b": b})  # type: ignore[arg-type]
    assert isinstance(state.replicas, ReplicaTable)
    assert state.replicas_of("m1") == [a] and state.replicas_of("m3") == []
    assert list(state.replicas.on_node("n2")) == [a, b] and not list(state.replicas.on_node("n9"))
    # Same model and nodes under the same id: the place in the indexes is kept.
    a2 = replica("a", "m1", ["n1", "n2"])
    state.replicas["a"] = a2
    assert list(state.replicas.on_node("n2")) == [a2, b]
