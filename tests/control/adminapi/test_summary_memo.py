"""Views reused between summaries never hide a change.

The summary reuses a node's or replica's view while its inputs are the same
objects and values; these tests change each input in place, the way the
control plane does, and expect the next summary to see it.
"""

from __future__ import annotations

from tests.control.adminapi.fleetkit import Fleet, gpu, gpus

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, Summary, fleet_summary
from llmgw.wire import NodeInventory, NodeState, ReplicaState


def summary(fleet: Fleet, now: float | None = None) -> Summary:
    return fleet_summary(fleet.state, fleet.now if now is None else now, StoreStatus(members=[]))


def test_replica_changes_show_in_the_next_summary() -> None:
    fleet = Fleet()
    fleet.node("memo-n1", gpus(4))
    fleet.model("memo-m", min_replicas=1, max_replicas=2)
    replica = fleet.replica("memo-m", "memo-n1", [0], idle=IDLE_THRESHOLD_S - 5)
    first = summary(fleet)
    assert first.replicas.ready == 1 and first.idle_replicas == []
    # Only the clock moves: the reused view's idle time moves with it.
    later = summary(fleet, fleet.now + 10)
    assert [r.id for r in later.idle_replicas] == [replica.id]
    replica.state = ReplicaState.FAILED
    assert summary(fleet).replicas.failed == 1
    replica.state = ReplicaState.READY
    replica.last_request_at = fleet.now
    assert summary(fleet, fleet.now + 10).idle_replicas == []


def test_node_changes_show_in_the_next_summary() -> None:
    fleet = Fleet()
    node = fleet.node("memo-n2", gpus(2))
    fleet.model("memo-m2")
    first = summary(fleet)
    assert [(c.gpu_class, c.free) for c in first.gpus] == [("h100-80g", 2)]
    fleet.replica("memo-m2", "memo-n2", [1])
    assert [(c.free, c.used) for c in summary(fleet).gpus] == [(1, 1)]
    node.inventory = NodeInventory(hostname="memo-n2", source="fake",
                                   devices=[gpu(0, healthy=False), gpu(1)])
    assert [(c.free, c.used, c.unhealthy) for c in summary(fleet).gpus] == [(0, 1, 1)]
    node.admin_state = NodeState.CORDONED
    assert summary(fleet).nodes.cordoned == 1
    node.last_seen = fleet.now - 3600
    assert summary(fleet).nodes.unreachable == 1
