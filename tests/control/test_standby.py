"""Two control-plane instances on one PostgreSQL database: one leads, one stands by.

Real servers on loopback: a standby refuses the leader's work with 503 and the
leader's URL; an agent and a standalone gateway given both URLs work with the
leader, and move to the standby when it takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest
from tests.control.planekit import bearer, send_report
from tests.control.standby_kit import Pair, inventory, stub_agent
from tests.waiting import eventually

from llmgw.control.gateway_link import InProcessLink
from llmgw.control.plane import ControlPlane
from llmgw.control.rows import replica_row
from llmgw.errors import StandbyError
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.wire import (
    LEADER_HEADER,
    STANDBY_CODE,
    GatewayLoadReport,
    ModelSpec,
    ReplicaLoad,
    ReplicaState,
    UsageRecord,
)


async def test_a_standby_refuses_writes_naming_the_leader_and_serves_admin_reads(
    pair: Pair,
) -> None:
    leader, standby, creds = pair
    assert creds.join_token and creds.gateway_token and creds.admin_token
    await leader.cp.catalog.put([ModelSpec(name="m", engine="sim")])
    admin, gateway = bearer(creds.admin_token), bearer(creds.gateway_token)
    async with httpx.AsyncClient(base_url=standby.url, timeout=10) as http:
        refused = [
            await http.post("/agent/v1/register", json={"node": "n1"},
                            headers=bearer(creds.join_token)),
            # Refused before the token is looked at (a standby's view of the
            # nodes may not hold a node registered a moment ago).
            await http.post("/agent/v1/report", json={}, headers={"Authorization": "Bearer x"}),
            await http.get("/gateway/v1/config", params={"after": -1}, headers=gateway),
            await http.post("/gateway/v1/load", json={"gateway_id": "g"}, headers=gateway),
            await http.post("/gateway/v1/demand", json={"model": "m"}, headers=gateway),
            await http.post("/gateway/v1/usage", json=[], headers=gateway),
            await http.post("/admin/v1/nodes/n1/cordon", headers=admin),
            await http.delete("/admin/v1/models/m", headers=admin),
            await http.post("/admin/v1/join-token/rotate", headers=admin),
            await http.get("/healthz/leader"),
        ]
        for answer in refused:
            assert answer.status_code == 503, (answer.request.url, answer.text)
            assert answer.headers[LEADER_HEADER] == leader.url
            assert answer.headers["Retry-After"] == "1"
            error = answer.json()["error"]
            assert error["code"] == STANDBY_CODE and error["leader"] == leader.url
            assert leader.url in error["message"]

        # Reads are served from the standby's own (refreshed) views.
        await standby.cp.load()
        models = await http.get("/admin/v1/models", headers=admin)
        assert models.status_code == 200 and [m["name"] for m in models.json()] == ["m"]
        assert (await http.get("/healthz")).json()["leader"] is False
        # Credentials are still checked on the reads a standby serves.
        assert (await http.get("/admin/v1/models")).status_code == 401
    async with httpx.AsyncClient(base_url=leader.url, timeout=10) as http:
        assert (await http.get("/healthz/leader")).status_code == 200
    assert "m" in standby.cp.state.models  # the refused delete changed nothing


async def test_the_in_process_gateway_of_a_standby_keeps_usage_and_refuses_demand(
    pair: Pair,
) -> None:
    _, standby, _ = pair
    link = InProcessLink(standby.cp)
    await link.report_usage([UsageRecord(minute=60, key_id="k", model="m", requests=2)])
    assert [r["requests"] for r in await standby.store.query_usage()] == [2]
    await link.report_load(GatewayLoadReport(gateway_id="g"))  # dropped, not an error
    with pytest.raises(StandbyError):
        await link.demand("m")


async def test_agents_and_gateways_follow_the_leader_across_a_failover(
    pair: Pair, tmp_path: Path,
) -> None:
    leader, standby, creds = pair
    await leader.cp.catalog.put([ModelSpec(name="m", engine="sim")])
    agent = stub_agent(f"{standby.url},{leader.url}", tmp_path / "n1", creds.join_token)
    assert creds.gateway_token
    link = HttpControlPlaneLink([standby.url, leader.url], creds.gateway_token)
    run = asyncio.create_task(agent.run())
    try:
        # Listed second, the leader is where the agent registers and reports,
        # and where its replica is placed and becomes ready.
        def replica_ready(cp: ControlPlane) -> bool:
            return any(r.state == ReplicaState.READY for r in cp.state.replicas.values())

        await eventually(lambda: replica_ready(leader.cp), 15, "a ready replica on the leader")
        assert agent.identity is not None and list(agent.runners)
        token = agent.identity.node_token
        config = await link.watch_config(-1)
        assert [len(route.endpoints) for route in config.routing.models] == [1]
        await link.demand("m")

        # The standby answers the agent's own report with the leader's URL.
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await send_report(http, standby.url, token, agent.build_report(inventory()))
        assert answer.status_code == 503 and answer.headers[LEADER_HEADER] == leader.url

        # The leader goes; the standby takes over, and the agent and the
        # gateway move to it: same node token, same replica, no new register.
        await leader.stop()
        stopped_at = time.time()
        await eventually(lambda: standby.cp.is_leader, 10, "the standby to take over")
        node = standby.cp.state.nodes["n1"]
        await eventually(lambda: (node.last_seen or 0) > stopped_at, 12,
                         "the agent's report at the new leader")
        assert agent.identity.node_token == token and not run.done()
        events = await standby.store.list_events(kind="node", subject="n1")
        assert [e["message"] for e in events] == ["node n1 registered"]
        assert replica_ready(standby.cp)

        config = await asyncio.wait_for(link.watch_config(config.routing.version), 10)
        assert [len(route.endpoints) for route in config.routing.models] == [1]
        await link.demand("m")
        assert link.leader.current == standby.url
    finally:
        await agent.shutdown(stop_engines=True)
        await link.close()
        with contextlib.suppress(asyncio.CancelledError):
            await run


async def test_a_standby_shows_a_replica_busy_while_the_leader_hears_of_requests_in_flight(
    pair: Pair, tmp_path: Path,
) -> None:
    # Gateways report requests in flight to the leader only; a standby's
    # summary is built from the store. A replica streaming one long request
    # must read as busy on both: idle time 0, never in idle_replicas.
    leader, standby, creds = pair
    await leader.cp.catalog.put([ModelSpec(name="m", engine="sim")])
    assert creds.admin_token and creds.gateway_token
    agent = stub_agent(leader.url, tmp_path / "n1", creds.join_token)
    run = asyncio.create_task(agent.run())
    admin, gateway = bearer(creds.admin_token), bearer(creds.gateway_token)

    def ready(cp: ControlPlane) -> list[str]:
        return [r.id for r in cp.state.replicas.values() if r.state == ReplicaState.READY]

    async def views(http: httpx.AsyncClient, url: str) -> tuple[list[str], int, int]:
        """(idle replica ids in the summary, the replica's idle seconds, its in flight)."""
        summary = (await http.get(f"{url}/admin/v1/summary", headers=admin)).json()
        (replica,) = (await http.get(f"{url}/admin/v1/replicas", headers=admin)).json()
        return ([r["id"] for r in summary["idle_replicas"]], replica["idle_seconds"],
                replica["in_flight"])

    async def stored_in_flight(expected: int) -> bool:
        (row,) = await standby.store.list_replicas()
        return bool(row["in_flight"] == expected)

    async def load(http: httpx.AsyncClient, in_flight: int) -> None:
        body = GatewayLoadReport(gateway_id="g1", replicas=[
            ReplicaLoad(replica_id=rid, in_flight=in_flight, last_request_at=long_ago)])
        answer = await http.post(f"{leader.url}/gateway/v1/load", headers=gateway,
                                 content=body.model_dump_json())
        assert answer.status_code in (200, 204), answer.text

    try:
        await eventually(lambda: bool(ready(leader.cp)), 15, "a ready replica on the leader")
        (rid,) = ready(leader.cp)
        # Ready for half an hour, its last request sent 25 minutes ago.
        replica = leader.cp.state.replicas[rid]
        long_ago = time.time() - 25 * 60
        replica.ready_at = replica.created_at = time.time() - 30 * 60
        await leader.cp.writes.write_replicas([replica_row(replica)])
        async with httpx.AsyncClient(timeout=10) as http:
            # Unused: idle on both (the test can tell idle from busy).
            await standby.cp.load()
            for url in (leader.url, standby.url):
                idle, seconds, _ = await views(http, url)
                assert idle == [rid] and seconds >= 29 * 60, url

            # A gateway reports the request it has been streaming for 25 minutes.
            await load(http, 1)
            # The leader's own flush loop stores it (every 5 s), fenced.
            await eventually(lambda: stored_in_flight(1), 12, "the leader to store the request",
                             every_s=0.2)
            await standby.cp.load()  # what its 5-second refresh does
            for url in (leader.url, standby.url):
                assert await views(http, url) == ([], 0, 1), url

            # The request ends: idle counts from its end, not from when it was sent.
            await load(http, 0)
            await eventually(lambda: stored_in_flight(0), 12, "the leader to store the end",
                             every_s=0.2)
            await standby.cp.load()
            for url in (leader.url, standby.url):
                idle, seconds, in_flight = await views(http, url)
                assert idle == [] and seconds < 60 and in_flight == 0, (url, seconds)
            # Nothing changed since: a flush writes no row (the write rate is bounded).
            assert await leader.cp.replicas.flush_activity() == 0
    finally:
        await agent.shutdown(stop_engines=True)
        with contextlib.suppress(asyncio.CancelledError):
            await run
