"""Requests in flight reach the control plane from every gateway, summed (control/inflight.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.control.adminapi.fleetkit import Fleet

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, fleet_summary
from llmgw.control.inflight import STALE_AFTER_S, InFlightBook
from llmgw.control.service import ControlPlane
from llmgw.control.store.repo import Store
from llmgw.wire import GatewayLoadReport, ReplicaLoad


def report(gateway: str, replica: str, in_flight: int) -> GatewayLoadReport:
    return GatewayLoadReport(
        gateway_id=gateway, replicas=[ReplicaLoad(replica_id=replica, in_flight=in_flight)]
    )


def test_a_quiet_gateway_does_not_erase_another_gateways_long_request(tmp_path: Path) -> None:
    fleet = Fleet(now=time.time())
    fleet.node("n1")
    fleet.model("m", min_replicas=0, max_replicas=1)
    replica = fleet.replica("m", "n1", [0], idle=3 * IDLE_THRESHOLD_S)

    async def main() -> None:
        store = await Store.open(f"sqlite:///{tmp_path / 'llmgw.db'}")
        try:
            cp = ControlPlane(store, fleet.state)
            await cp.record_load(report("gw-a", replica.id, 1))
            await cp.record_load(report("gw-b", replica.id, 0))
            assert replica.in_flight == 1
            await cp.record_load(report("gw-b", replica.id, 2))
            assert replica.in_flight == 3
            await cp.record_load(report("gw-a", replica.id, 0))
            await cp.record_load(report("gw-b", replica.id, 0))
            assert replica.in_flight == 0
        finally:
            await store.close()

    asyncio.run(main())


def test_the_summary_sees_the_request_another_gateway_holds(tmp_path: Path) -> None:
    fleet = Fleet(now=time.time())
    fleet.node("n1")
    fleet.model("m", min_replicas=0, max_replicas=1)
    replica = fleet.replica("m", "n1", [0], idle=3 * IDLE_THRESHOLD_S)

    async def main() -> None:
        store = await Store.open(f"sqlite:///{tmp_path / 'llmgw.db'}")
        try:
            cp = ControlPlane(store, fleet.state)
            await cp.record_load(report("gw-a", replica.id, 1))
            await cp.record_load(report("gw-b", replica.id, 0))
        finally:
            await store.close()

    asyncio.run(main())
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
