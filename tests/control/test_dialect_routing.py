"""The control plane passes each replica's engine dialect into the routing table."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.control.test_agent_api import inventory, register
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.control.state import ReplicaRecord
from llmgw.wire import (
    AgentReport,
    EngineDialect,
    ModelSpec,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
)

Plane = tuple[ControlPlane, NewCredentials, str]
IGNORANT = EngineDialect(max_completion_tokens=False, stream_usage=False,
                         tokenize_path="/extras/tokenize/count")  # fmt: skip


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    from llmgw.control.store.repo import Store

    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    async with serve_asgi(create_app(cp)) as url:
        yield cp, creds, url
    await store.close()


async def test_the_routing_table_carries_each_endpoints_dialect(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.put_models([ModelSpec(name="m", engine="sim")])
    cp.state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0, shards=[ShardAssignment(node="n1", device_numbers=[0])]
    )

    async def report(dialect: EngineDialect | None) -> None:
        status = ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4000,
                               dialect=dialect)  # fmt: skip
        body = AgentReport(node="n1", inventory=inventory("h"), replicas=[status])
        answer = await client.post(f"{url}/agent/v1/report", content=body.model_dump_json(),
                                   headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert answer.status_code == 200, answer.text

    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        await report(IGNORANT)
        (endpoint,) = cp.gateway_config().routing.models[0].endpoints
        assert endpoint.dialect == IGNORANT
        version = cp.gateway_config().routing.version
        # The same dialect again changes nothing; an agent that stops
        # declaring one (an older agent adopted the engine) changes the table.
        await report(IGNORANT)
        assert cp.gateway_config().routing.version == version
        await report(None)
        assert cp.gateway_config().routing.version > version
        (endpoint,) = cp.gateway_config().routing.models[0].endpoints
        assert endpoint.dialect is None
