"""A node's fabrics are an operator's word: a report only proposes them (issue 13).

Fabrics decide which peers a node copies weights from and which multi-node
replicas it joins; taken from a report, one node given a join token could
name itself into any fabric.
"""

from __future__ import annotations

import httpx
from tests.control.planekit import Plane, inventory, register, report_ok

from llmgw.wire import AgentReport

# Two CPU slots on two nodes, one replica across both: it needs one fabric.
BIG = {"models": [{"name": "big", "engine": "sim", "gpu_classes": ["cpu"], "gpus": 2,
                   "nodes": 2, "pp": 2}]}


async def _both_nodes_report_ib_a(client: httpx.AsyncClient, plane: Plane) -> None:
    for node in ("n1", "n2"):
        token = await register(client, plane.url, plane.join, node)
        await report_ok(client, plane.url, token,
                        AgentReport(node=node, inventory=inventory(node), fabrics=["ib-a"]))


async def _big(client: httpx.AsyncClient, plane: Plane) -> dict[str, object]:
    plan = await client.post(f"{plane.url}/admin/v1/plan", json=BIG, headers=plane.admin)
    assert plan.status_code == 200, plan.text
    model: dict[str, object] = plan.json()["models"][0]
    return model


async def test_reported_fabrics_change_no_placement_until_an_operator_sets_them(
    plane: Plane,
) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        await _both_nodes_report_ib_a(client, plane)
        big = await _big(client, plane)
        assert big["reason"] == ("needs 2 nodes with 1 cpu in one fabric;"
                                 " no node with cpu is in a fabric")
        view = (await client.get(f"{url}/admin/v1/nodes/n1", headers=plane.admin)).json()
        assert view["fabrics"] == []
        assert view["warnings"][0] == ("reports fabrics ib-a; not used until an operator"
                                       " sets them: llmgw ctl nodes fabrics n1 ib-a")
        for node in ("n1", "n2"):
            pinned = await client.put(f"{url}/admin/v1/nodes/{node}/fabrics",
                                      headers=plane.admin, json={"fabrics": ["ib-a"]})
            assert pinned.status_code == 200
        big = await _big(client, plane)
        assert big["reason"] is None and big["status"] != "can never fit"
    assert cp.state.nodes["n1"].fabrics == ["ib-a"]


async def test_serve_can_trust_reported_fabrics(plane: Plane) -> None:
    cp, _, url = plane
    cp.trust_reported_fabrics = True  # serve --trust-reported-fabrics
    async with httpx.AsyncClient() as client:
        await _both_nodes_report_ib_a(client, plane)
        big = await _big(client, plane)
        assert big["reason"] is None
        view = (await client.get(f"{url}/admin/v1/nodes/n1", headers=plane.admin)).json()
        assert view["fabrics"] == ["ib-a"] and view["warnings"] == []
