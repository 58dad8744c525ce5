"""The replica lifecycle (control/state.py): every allowed change, every refused one,
and the paths that change a replica's state going through it."""

from __future__ import annotations

import itertools

import pytest

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.control.plane import ControlPlane
from llmgw.control.reports import apply_report, assignments_for
from llmgw.control.rows import replica_from_row, replica_row
from llmgw.control.state import REPLICA_TRANSITIONS, FleetState, NodeRecord, ReplicaRecord
from llmgw.errors import TransitionError
from llmgw.wire import (
    AgentReport,
    ModelSpec,
    NodeInventory,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
)

S = ReplicaState
ALLOWED = [
    (S.STARTING, S.STARTING),  # a restart under a new generation
    (S.STARTING, S.READY),
    (S.STARTING, S.DRAINING),
    (S.STARTING, S.FAILED),
    (S.READY, S.STARTING),  # a restart under a new generation
    (S.READY, S.DRAINING),
    (S.READY, S.FAILED),
]
REFUSED = [pair for pair in itertools.product(S, S) if pair not in ALLOWED]


def replica(state: ReplicaState) -> ReplicaRecord:
    return ReplicaRecord(id="r1", model="m", created_at=0.0, state=state, reason="before",
                         shards=[ShardAssignment(node="n1", device_numbers=[0])])


def test_the_table_is_the_list_above() -> None:
    assert {(a, b) for a, targets in REPLICA_TRANSITIONS.items() for b in targets} == set(ALLOWED)
    assert len(REFUSED) == 16 - len(ALLOWED)


@pytest.mark.parametrize(("source", "target"), ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_allowed_transition(source: ReplicaState, target: ReplicaState) -> None:
    record = replica(source)
    assert record.can_move_to(target)
    record.move_to(target, "why")
    assert (record.state, record.reason) == (target, "why")
    assert record.draining is (target is S.DRAINING)


@pytest.mark.parametrize(("source", "target"), REFUSED, ids=[f"{a}->{b}" for a, b in REFUSED])
def test_refused_transition(source: ReplicaState, target: ReplicaState) -> None:
    record = replica(source)
    assert not record.can_move_to(target)
    refused = f"is {source.value} and cannot become {target.value}"
    with pytest.raises(TransitionError, match=refused):
        record.move_to(target, "why")
    assert (record.state, record.reason) == (source, "before")  # unchanged


def test_restart_bumps_the_generation_and_forgets_readiness() -> None:
    record = replica(S.READY)
    record.ready_at = 5.0
    record.restart()
    assert (record.state, record.generation, record.ready_at) == (S.STARTING, 2, None)
    for gone in (S.DRAINING, S.FAILED):
        with pytest.raises(TransitionError):
            replica(gone).restart()


def test_draining_is_a_state_in_rows_and_in_the_agents_instruction() -> None:
    record = replica(S.READY)
    row = replica_row(record, draining=True)  # the reconciler writes before it applies
    assert (row["state"], row["draining"]) == ("draining", True)
    assert replica_from_row(row).state is S.DRAINING
    # A row written when draining was a flag beside "ready" reads as draining.
    old = replica_row(record) | {"draining": True}
    assert replica_from_row(old).state is S.DRAINING
    assert replica_from_row(replica_row(replica(S.FAILED)) | {"draining": True}).state is S.FAILED


@pytest.fixture
async def r1_ready(cp: ControlPlane) -> None:
    """Model m in the catalog and its replica r1 ready on n1, in memory and stored."""
    await cp.catalog.put([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"])])
    record = replica(S.READY)
    record.port, record.ready_at = 30001, 1.0
    cp.state.replicas[record.id] = record
    await cp.store.write_replicas([replica_row(record)])


@pytest.mark.usefixtures("r1_ready")
async def test_a_drained_replica_is_draining_everywhere_and_never_idle(cp: ControlPlane) -> None:
    drained = await cp.replicas.drain("r1")
    assert drained.state is S.DRAINING
    assert (await cp.replicas.drain("r1")).state is S.DRAINING  # twice: no error
    summary = fleet_summary(cp.state, 10_000.0, StoreStatus(members=[]))
    assert (summary.replicas.ready, summary.replicas.draining) == (0, 1)
    assert summary.idle_replicas == []  # idle for hours, but leaving
    (assignment,) = assignments_for(cp.state, "n1")
    assert assignment.draining
    assert cp.gateways.config().routing.models[0].endpoints == []
    (row,) = await cp.store.list_replicas()
    assert (row["state"], row["draining"]) == ("draining", True)
    # A catalog change does not bring it back.
    await cp.catalog.put([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"],
                                   max_replicas=2)])
    assert cp.state.replicas["r1"].state is S.DRAINING


@pytest.mark.usefixtures("r1_ready")
async def test_a_failed_replica_cannot_be_drained(cp: ControlPlane) -> None:
    cp.state.replicas["r1"].move_to(S.FAILED, "engine exited (1)")
    with pytest.raises(TransitionError, match="is failed and cannot become draining"):
        await cp.replicas.drain("r1")


def test_reports_move_replicas_through_the_table() -> None:
    state = FleetState()
    node = NodeRecord(name="n1", registered_at=0.0)
    state.nodes["n1"] = node
    record = replica(S.DRAINING)
    state.replicas["r1"] = record

    def report(status: ReplicaState, replica_id: str = "r1") -> None:
        line = ReplicaStatus(replica_id=replica_id, generation=1, state=status, port=30001)
        inventory = NodeInventory(hostname="n1")
        apply_report(state, node, AgentReport(node="n1", inventory=inventory, replicas=[line]), 1.0)

    report(S.READY)  # an agent still saying ready does not undo a drain
    assert record.state is S.DRAINING
    # Its engine exits while draining: it was stopping anyway, so it stays
    # draining (no failed start counted) and the reconciler removes it.
    effects = apply_report(state, node, AgentReport(
        node="n1", inventory=NodeInventory(hostname="n1"), replicas=[ReplicaStatus(
            replica_id="r1", generation=1, state=S.FAILED, exit_code=0)]), 2.0)
    assert (record.state, record.reason) == (S.DRAINING, "engine exited (0) while draining")
    assert effects.wake_reconciler and not effects.replicas
    other = replica(S.READY)
    other.id = "r2"
    state.replicas["r2"] = other
    apply_report(state, node, AgentReport(node="n1", inventory=NodeInventory(hostname="n1"),
                                          replicas=[], refused={"r1": "x", "r2": "bad shard"}), 3.0)
    assert record.state is S.DRAINING  # a refusal of a draining replica changes nothing
    assert (other.state, other.reason) == (S.FAILED, "refused by agent on n1: bad shard")
    report(S.READY, "r2")  # failed is final
    assert other.state is S.FAILED
