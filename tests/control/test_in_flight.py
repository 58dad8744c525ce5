"""Requests in flight reach the control plane from every gateway, summed (control/inflight.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.control.adminapi.fleetkit import Fleet

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, fleet_summary
from llmgw.control.inflight import ACTIVITY_SLACK_S, STALE_AFTER_S, InFlightBook, StoredActivity
from llmgw.control.plane import ControlPlane
from llmgw.control.state import ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.wire import GatewayLoadReport, ReplicaLoad


def report(gateway: str, replica: str, in_flight: int) -> GatewayLoadReport:
    return GatewayLoadReport(
        gateway_id=gateway, replicas=[ReplicaLoad(replica_id=replica, in_flight=in_flight)]
    )


def idle_replica() -> tuple[Fleet, ReplicaRecord]:
    """A fleet with one replica, idle long enough to be a candidate for stopping."""
    fleet = Fleet(now=time.time())
    fleet.node("n1")
    fleet.model("m", min_replicas=0, max_replicas=1)
    return fleet, fleet.replica("m", "n1", [0], idle=3 * IDLE_THRESHOLD_S)


def record_loads(tmp_path: Path, fleet: Fleet, replica: ReplicaRecord,
                 loads: list[tuple[str, int]]) -> list[int]:
    """Each (gateway, in flight) reported in turn; the replica's summed count after each."""

    async def main() -> list[int]:
        store = await Store.open(f"sqlite:///{tmp_path / 'llmgw.db'}")
        try:
            cp = ControlPlane(store, fleet.state)
            seen = []
            for gateway, in_flight in loads:
                await cp.gateways.record_load(report(gateway, replica.id, in_flight))
                seen.append(replica.in_flight)
            return seen
        finally:
            await store.close()

    return asyncio.run(main())


def test_a_quiet_gateway_does_not_erase_another_gateways_long_request(tmp_path: Path) -> None:
    fleet, replica = idle_replica()
    loads = [("gw-a", 1), ("gw-b", 0), ("gw-b", 2), ("gw-a", 0), ("gw-b", 0)]
    assert record_loads(tmp_path, fleet, replica, loads) == [1, 1, 3, 2, 0]


def test_the_summary_sees_the_request_another_gateway_holds(tmp_path: Path) -> None:
    fleet, replica = idle_replica()
    record_loads(tmp_path, fleet, replica, [("gw-a", 1), ("gw-b", 0)])
    summary = fleet_summary(fleet.state, time.time(), StoreStatus(members=[]))
    assert summary.idle_replicas == []


def test_a_gateway_that_stopped_reporting_pins_nothing_for_long() -> None:
    book = InFlightBook()
    assert book.record("r1", "gw-a", 4, now=100.0) == 4
    assert book.record("r1", "gw-b", 1, now=100.0 + STALE_AFTER_S) == 5
    assert book.record("r1", "gw-b", 1, now=100.0 + STALE_AFTER_S + 1) == 1  # gw-a went quiet
    assert book.record("r1", "gw-b", -3, now=200.0) == 0  # nonsense counts as none


def test_counts_of_removed_replicas_are_forgotten() -> None:
    book = InFlightBook()
    book.record("r1", "gw-a", 2, now=0.0)
    book.record("r2", "gw-a", 2, now=0.0)
    book.forget_except({"r2"})
    assert book.record("r1", "gw-b", 0, now=1.0) == 0
    assert book.record("r2", "gw-b", 0, now=1.0) == 2


def test_stored_use_is_written_on_a_turn_busy_or_quiet_and_else_at_a_bounded_rate() -> None:
    stored = StoredActivity()
    stored.stored({"r1": (0, 100.0), "r2": (2, 100.0)})
    # Nothing moved: nothing to write.
    assert stored.due({"r1": (0, 100.0), "r2": (2, 100.0)}) == {}
    # Busy now (r1), another request on a busy one (r2), its last use moved a little.
    assert stored.due({"r1": (1, 101.0), "r2": (3, 110.0)}) == {"r1": (1, 101.0)}
    stored.stored({"r1": (1, 101.0)})
    # A long request: its last use moves every report, written once it moved the slack.
    assert stored.due({"r1": (1, 101.0 + ACTIVITY_SLACK_S - 1), "r2": (2, 100.0)}) == {}
    assert stored.due({"r1": (1, 101.0 + ACTIVITY_SLACK_S), "r2": (2, 100.0)}) == {
        "r1": (1, 101.0 + ACTIVITY_SLACK_S)
    }
    # A new replica is written once; a removed one is forgotten.
    assert stored.due({"r3": (0, None)}) == {"r3": (0, None)}
    assert stored.due({"r1": (1, 101.0)}) == {"r1": (1, 101.0)}  # absent from the last call


def test_a_replica_in_use_counts_as_used_now_so_idle_time_runs_from_the_requests_end(
    tmp_path: Path,
) -> None:
    fleet, replica = idle_replica()
    # Sent 30 minutes ago, ended now.
    record_loads(tmp_path, fleet, replica, [("gw-a", 1), ("gw-a", 0)])
    idle = replica.idle_seconds(time.time())
    assert idle is not None and idle < 60
    assert fleet_summary(fleet.state, time.time(), StoreStatus(members=[])).idle_replicas == []


def test_a_load_report_that_moves_nothing_writes_nothing(tmp_path: Path) -> None:
    # The summary keeper reads the replicas written to since its last call
    # (the replica table's write log): a report a second naming every replica, most
    # of them unchanged, must not list them all.
    fleet, replica = idle_replica()

    async def main() -> list[int]:
        store = await Store.open(f"sqlite:///{tmp_path / 'llmgw.db'}")
        try:
            cp = ControlPlane(store, fleet.state)
            written = []
            log = fleet.state.replicas.writes
            for in_flight in (0, 0, 2, 2):
                position = log.position()
                await cp.gateways.record_load(report("gw-a", replica.id, in_flight))
                written.append(len(log.since(position) or []))
            return written
        finally:
            await store.close()

    # In flight moved (and, busy, its last use) at the third report only;
    # the fourth moves its last use alone.
    assert asyncio.run(main()) == [0, 0, 2, 1]
