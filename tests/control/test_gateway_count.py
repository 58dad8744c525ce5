"""The routing table tells gateways how many of them route (control/gateway_count.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.control.test_in_flight import idle_replica, report

from llmgw.control.gateway_count import SETTLE_S, GatewayCount, LastReport, placement
from llmgw.control.inflight import STALE_AFTER_S
from llmgw.control.plane import ControlPlane
from llmgw.control.store.repo import Store


def test_no_count_until_reports_have_come_in_for_a_while() -> None:
    # A control plane just started (or just taken over) has heard one
    # gateway before the others' first reports: "1" then would send every
    # gateway down the lone path at once.
    count = GatewayCount()
    assert not count.heard("gw-a", now=100.0)
    assert not count.heard("gw-b", now=100.5)
    assert count.count == 0
    assert count.heard("gw-a", now=100.0 + SETTLE_S)
    assert count.count == 2
    assert not count.heard("gw-b", now=101.0 + SETTLE_S)  # nothing moved


def test_a_gateway_that_stopped_reporting_is_no_longer_counted() -> None:
    count = GatewayCount(settle_s=0.0)
    assert count.heard("gw-a", now=0.0) and count.count == 1
    assert count.heard("gw-b", now=1.0) and count.count == 2
    for t in range(2, int(STALE_AFTER_S) + 1):
        assert not count.heard("gw-b", now=float(t))
    # gw-a's last report is now older than STALE_AFTER_S.
    assert count.heard("gw-b", now=STALE_AFTER_S + 1.0) and count.count == 1
    assert count.heard("gw-a", now=STALE_AFTER_S + 2.0) and count.count == 2


def test_each_gateways_last_report_is_kept_in_brief() -> None:
    count = GatewayCount(settle_s=0.0)
    count.heard("gw-a", now=10.0, in_flight=3, waiting={"chat": 2})
    count.heard("gw-b", now=11.0)
    count.heard("gw-a", now=12.0, in_flight=1)  # the last report replaces the one before
    assert count.reporting(now=12.5) == {
        "gw-a": LastReport(at=12.0, in_flight=1, waiting={}),
        "gw-b": LastReport(at=11.0, in_flight=0, waiting={}),
    }


def test_reading_forgets_stale_gateways_but_not_the_tables_count() -> None:
    # With every gateway stopped no report comes to forget them: the list
    # must not show them for ever. The count is the table's, which only a
    # report changes (a read making a new table would be a write).
    count = GatewayCount(settle_s=0.0)
    count.heard("gw-a", now=0.0)
    count.heard("gw-b", now=10.0)
    assert set(count.reporting(now=STALE_AFTER_S)) == {"gw-a", "gw-b"}
    assert set(count.reporting(now=STALE_AFTER_S + 1.0)) == {"gw-b"}
    assert count.count == 2
    assert count.reporting(now=STALE_AFTER_S + 11.0) == {}
    # The next report counts from what is left.
    assert count.heard("gw-c", now=STALE_AFTER_S + 12.0) and count.count == 1


def test_placement_follows_the_count_as_gateways_read_it() -> None:
    # gateway.snapshot: only exactly one is alone; 0 ("not known yet") is several.
    assert [placement(n) for n in (0, 1, 2, 5)] == ["settling", "by load", "by hash", "by hash"]


def test_the_table_carries_the_count_and_a_change_is_a_new_table(tmp_path: Path) -> None:
    fleet, replica = idle_replica()

    async def main() -> list[tuple[int, int]]:
        store = await Store.open(f"sqlite:///{tmp_path / 'llmgw.db'}")
        try:
            cp = ControlPlane(store, fleet.state)
            cp.gateways._gateway_count = GatewayCount(settle_s=0.0)
            seen = [(cp.gateways.config().routing.gateways, fleet.state.routing_version)]
            for gateway in ("gw-a", "gw-a", "gw-b", "gw-a"):
                await cp.gateways.record_load(report(gateway, replica.id, 0))
                table = (await cp.gateways.watch(seen[-1][1], wait_s=0.0)).routing
                seen.append((table.gateways, table.version))
            return seen
        finally:
            await store.close()

    (none, v0), *after = asyncio.run(main())
    assert none == 0
    # A second report from the same gateway, or a third from either, is no change.
    assert after == [(1, v0 + 1), (1, v0 + 1), (2, v0 + 2), (2, v0 + 2)]
