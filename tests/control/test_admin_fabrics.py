"""A node's fabrics are an operator's word: a report only proposes them (issue 13).

Fabrics decide which peers a node copies weights from and which multi-node
replicas it joins; taken from a report, one node given a join token could
name itself into any fabric.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.control.test_agent_api import inventory, register
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.control.store.repo import Store
from llmgw.wire import AgentReport

Plane = tuple[ControlPlane, NewCredentials, str]
# Two CPU slots on two nodes, one replica across both: it needs one fabric.
BIG = {"models": [{"name": "big", "engine": "sim", "gpu_classes": ["cpu"], "gpus": 2,
                   "nodes": 2, "pp": 2}]}


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    async with serve_asgi(create_app(cp)) as url:
        yield cp, creds, url
    await store.close()


async def _join(client: httpx.AsyncClient, url: str, join: str, node: str) -> None:
    token = await register(client, url, join, node)
    report = AgentReport(node=node, inventory=inventory(node), fabrics=["ib-a"])
    answer = await client.post(f"{url}/agent/v1/report", content=report.model_dump_json(),
                               headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text


async def _big(client: httpx.AsyncClient, url: str, admin: dict[str, str]) -> dict[str, object]:
    plan = await client.post(f"{url}/admin/v1/plan", json=BIG, headers=admin)
    assert plan.status_code == 200, plan.text
    model: dict[str, object] = plan.json()["models"][0]
    return model


async def test_reported_fabrics_change_no_placement_until_an_operator_sets_them(
    plane: Plane,
) -> None:
    cp, creds, url = plane
    assert creds.join_token and creds.admin_token
    admin = {"Authorization": f"Bearer {creds.admin_token}"}
    async with httpx.AsyncClient() as client:
        for node in ("n1", "n2"):
            await _join(client, url, creds.join_token, node)
        big = await _big(client, url, admin)
        assert big["reason"] == ("needs 2 nodes with 1 cpu in one fabric;"
                                 " no node with cpu is in a fabric")
        view = (await client.get(f"{url}/admin/v1/nodes/n1", headers=admin)).json()
        assert view["fabrics"] == []
        assert view["warnings"][0] == ("reports fabrics ib-a; not used until an operator"
                                       " sets them: llmgw ctl nodes fabrics n1 ib-a")
        for node in ("n1", "n2"):
            pinned = await client.put(f"{url}/admin/v1/nodes/{node}/fabrics", headers=admin,
                                      json={"fabrics": ["ib-a"]})
            assert pinned.status_code == 200
        big = await _big(client, url, admin)
        assert big["reason"] is None and big["status"] != "can never fit"
    assert cp.state.nodes["n1"].fabrics == ["ib-a"]


async def test_serve_can_trust_reported_fabrics(plane: Plane) -> None:
    cp, creds, url = plane
    cp.trust_reported_fabrics = True  # serve --trust-reported-fabrics
    assert creds.join_token and creds.admin_token
    admin = {"Authorization": f"Bearer {creds.admin_token}"}
    async with httpx.AsyncClient() as client:
        for node in ("n1", "n2"):
            await _join(client, url, creds.join_token, node)
        big = await _big(client, url, admin)
        assert big["reason"] is None
        view = (await client.get(f"{url}/admin/v1/nodes/n1", headers=admin)).json()
        assert view["fabrics"] == ["ib-a"] and view["warnings"] == []
