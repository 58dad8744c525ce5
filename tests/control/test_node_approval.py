"""serve --approve-nodes: a new node waits, cordoned and without the peer token,
until an operator approves it (issue 13)."""

from __future__ import annotations

import httpx
import pytest
from tests.control.planekit import Plane, inventory, register, report_ok, send_report

from llmgw.control.plane import ControlPlane
from llmgw.control.state import ReplicaRecord
from llmgw.wire import (
    AgentReport,
    ModelSpec,
    NodeState,
    ShardAssignment,
    WeightsDigests,
    WeightsEntry,
    WeightsSource,
)


@pytest.fixture
def plane(plane: Plane) -> Plane:
    """serve --approve-nodes (set before any node has registered)."""
    plane.cp.nodes.approve_nodes = True
    return plane


async def _report(client: httpx.AsyncClient, url: str, token: str,
                  fabrics: list[str] | None = None) -> dict[str, object]:
    report = AgentReport(node="n1", inventory=inventory("n1"), fabrics=fabrics or [])
    body: dict[str, object] = (await report_ok(client, url, token, report)).json()
    return body


async def test_a_new_node_waits_for_approval(plane: Plane) -> None:
    cp, _, url = plane
    admin = plane.admin
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        answer = await _report(client, url, token)
        assert answer["peer_token"] is None and answer["weight_peers"] == {}
        node = (await client.get(f"{url}/admin/v1/nodes/n1", headers=admin)).json()
        assert node["state"] == "cordoned"
        assert node["warnings"][0] == "waiting for approval: llmgw ctl nodes approve n1"
        # Uncordoning is not a way around the approval.
        refused = await client.post(f"{url}/admin/v1/nodes/n1/uncordon", headers=admin)
        assert refused.status_code == 422 and "approve" in refused.json()["error"]["message"]

        # Kept across a restart of the control plane.
        again = ControlPlane(cp.store)
        await again.load()
        assert again.state.nodes["n1"].pending_approval

        approved = await client.post(f"{url}/admin/v1/nodes/n1/approve", headers=admin)
        assert approved.status_code == 200, approved.text
        assert approved.json()["state"] == "ready" and approved.json()["warnings"] == []
        answer = await _report(client, url, token)
        assert answer["peer_token"] == cp.peer_token
        twice = await client.post(f"{url}/admin/v1/nodes/n1/approve", headers=admin)
        assert twice.status_code == 422
        events = (await client.get(f"{url}/admin/v1/events?subject=n1", headers=admin)).json()
    assert any(e["message"].startswith("node n1 approved") for e in events)
    assert cp.state.nodes["n1"].admin_state == NodeState.READY
    reloaded = ControlPlane(cp.store)
    await reloaded.load()
    assert not reloaded.state.nodes["n1"].pending_approval


async def test_without_the_flag_nodes_are_placed_at_once(plane: Plane) -> None:
    cp, _, url = plane
    cp.nodes.approve_nodes = False
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        answer = await _report(client, url, token)
    assert answer["peer_token"] == cp.peer_token
    assert cp.state.nodes["n1"].state(cp.state.nodes["n1"].last_seen or 0) == NodeState.READY


async def test_approval_pins_the_fabrics_the_operator_saw(plane: Plane) -> None:
    cp, _, url = plane
    admin = plane.admin
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        await _report(client, url, token, fabrics=["ib-a"])
        await client.post(f"{url}/admin/v1/nodes/n1/approve", headers=admin)
        # Later reports cannot move the node into another fabric.
        await _report(client, url, token, fabrics=["ib-secret"])
        node = (await client.get(f"{url}/admin/v1/nodes/n1", headers=admin)).json()
        assert node["fabrics"] == ["ib-a"]
        assert "reports fabrics ib-secret; kept ib-a" in node["warnings"][0]
        pinned = await client.put(f"{url}/admin/v1/nodes/n1/fabrics", headers=admin,
                                  json={"fabrics": ["ib-b"]})
        assert pinned.status_code == 200 and pinned.json()["fabrics"] == ["ib-b"]
        bad = await client.put(f"{url}/admin/v1/nodes/n1/fabrics", headers=admin,
                               json={"fabrics": ["[red]x"]})
        assert bad.status_code == 422
    reloaded = ControlPlane(cp.store)
    await reloaded.load()
    assert reloaded.state.nodes["n1"].fabrics_pinned
    assert reloaded.state.nodes["n1"].fabrics == ["ib-b"]
    async with httpx.AsyncClient() as client:
        # Unset: a report only proposes fabrics (serve --trust-reported-fabrics aside).
        freed = await client.delete(f"{url}/admin/v1/nodes/n1/fabrics", headers=admin)
        assert freed.json()["fabrics"] == []
        await _report(client, url, token, fabrics=["ib-c"])
    assert cp.state.nodes["n1"].fabrics == []


async def test_trusting_reported_fabrics_lets_reports_decide(plane: Plane) -> None:
    cp, _, url = plane
    cp.nodes.approve_nodes = False
    cp.trust_reported_fabrics = True
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        await _report(client, url, token, fabrics=["ib-a"])
        await _report(client, url, token, fabrics=["ib-b"])
    assert cp.state.nodes["n1"].fabrics == ["ib-b"]


async def test_a_node_waiting_for_approval_is_no_weight_source(plane: Plane) -> None:
    cp, _, url = plane
    source = WeightsSource(kind="package", package="m-weights")
    await cp.catalog.put([ModelSpec(name="m", engine="sim", weights=source)])
    # The copy n1 reports is the recorded one: only approval holds it back.
    cp.digests.records["m"] = WeightsDigests(source=source, origin="package", sha256="a" * 64)
    cp.state.replicas["r1"] = ReplicaRecord(id="r1", model="m", created_at=0.0,
                                            shards=[ShardAssignment(node="n2")])
    async with httpx.AsyncClient() as client:
        rogue = await register(client, url, plane.join, "n1")
        report = AgentReport(node="n1", inventory=inventory("n1"), agent_port=9999,
                             weights=[WeightsEntry(model="m", source=source, sha256="a" * 64)])
        await send_report(client, url, rogue, report)
        cp.nodes.approve_nodes = False
        honest = await register(client, url, plane.join, "n2")
        ask = AgentReport(node="n2", inventory=inventory("n2"))
        answer = await send_report(client, url, honest, ask)
        assert answer.json()["weight_peers"] == {}
        await cp.nodes.approve("n1")
        answer = await send_report(client, url, honest, ask)
        assert answer.json()["weight_peers"] == {"m": ["http://127.0.0.1:9999"]}
