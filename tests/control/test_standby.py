"""Two control-plane instances on one PostgreSQL database: one leads, one stands by.

Real servers on loopback: a standby refuses the leader's work with 503 and the
leader's URL; an agent and a standalone gateway given both URLs work with the
leader, and move to the standby when it takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from tests.agent.fakes import StubAdapter
from tests.agent.helpers import cpu_slot
from tests.control.standby_kit import Instance, leader_and_standby

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.gateway_link import InProcessLink
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.errors import StandbyError
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.wire import (
    LEADER_HEADER,
    STANDBY_CODE,
    EngineKind,
    GatewayLoadReport,
    ModelSpec,
    NodeInventory,
    ReplicaState,
    UsageRecord,
)


@pytest.fixture
async def pair(pg_database_url: str) -> AsyncIterator[tuple[Instance, Instance, NewCredentials]]:
    """(leader, standby, credentials) on one fresh database."""
    async with leader_and_standby(pg_database_url) as started:
        yield started


async def eventually(check: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def inventory() -> NodeInventory:
    return NodeInventory(hostname="n1", devices=[cpu_slot(0, "n1")])


async def test_a_standby_refuses_writes_naming_the_leader_and_serves_admin_reads(
    pair: tuple[Instance, Instance, NewCredentials],
) -> None:
    leader, standby, creds = pair
    assert creds.join_token and creds.gateway_token and creds.admin_token
    await leader.cp.put_models([ModelSpec(name="m", engine="sim")])
    admin = {"Authorization": f"Bearer {creds.admin_token}"}
    gateway = {"Authorization": f"Bearer {creds.gateway_token}"}
    async with httpx.AsyncClient(base_url=standby.url, timeout=10) as http:
        refused = [
            await http.post("/agent/v1/register", json={"node": "n1",
                                                        "join_token": creds.join_token}),
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
    pair: tuple[Instance, Instance, NewCredentials],
) -> None:
    _, standby, _ = pair
    link = InProcessLink(standby.cp)
    await link.report_usage([UsageRecord(minute=60, key_id="k", model="m", requests=2)])
    assert [r["requests"] for r in await standby.store.query_usage()] == [2]
    await link.report_load(GatewayLoadReport(gateway_id="g"))  # dropped, not an error
    with pytest.raises(StandbyError):
        await link.demand("m")


async def test_agents_and_gateways_follow_the_leader_across_a_failover(
    pair: tuple[Instance, Instance, NewCredentials], tmp_path: Path,
) -> None:
    leader, standby, creds = pair
    await leader.cp.put_models([ModelSpec(name="m", engine="sim")])
    agent = Agent(
        AgentConfig(control_plane=f"{standby.url},{leader.url}", data_dir=tmp_path / "n1",
                    name="n1", join_token=creds.join_token, stop_grace_s=2.0),
        inventory_provider=inventory, adapters={EngineKind.SIM: StubAdapter()},
    )
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
        report = agent.build_report(inventory())
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{standby.url}/agent/v1/report",
                                     content=report.model_dump_json(),
                                     headers={"Authorization": f"Bearer {token}"})
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
