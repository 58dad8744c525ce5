"""The control plane passes each replica's engine dialect into the routing table."""

from __future__ import annotations

import httpx
from tests.control.planekit import Plane, inventory, register, report_ok

from llmgw.control.state import ReplicaRecord
from llmgw.wire import (
    AgentReport,
    EngineDialect,
    ModelSpec,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
)

IGNORANT = EngineDialect(max_completion_tokens=False, stream_usage=False,
                         tokenize_path="/extras/tokenize/count")  # fmt: skip


async def test_the_routing_table_carries_each_endpoints_dialect(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    cp.state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0, shards=[ShardAssignment(node="n1", device_numbers=[0])]
    )

    async def report(dialect: EngineDialect | None) -> None:
        status = ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4000,
                               dialect=dialect)  # fmt: skip
        await report_ok(client, url, token,
                        AgentReport(node="n1", inventory=inventory("h"), replicas=[status]))

    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        await report(IGNORANT)
        (endpoint,) = cp.gateways.config().routing.models[0].endpoints
        assert endpoint.dialect == IGNORANT
        version = cp.gateways.config().routing.version
        # The same dialect again changes nothing; an agent that stops
        # declaring one (an older agent adopted the engine) changes the table.
        await report(IGNORANT)
        assert cp.gateways.config().routing.version == version
        await report(None)
        assert cp.gateways.config().routing.version > version
        (endpoint,) = cp.gateways.config().routing.models[0].endpoints
        assert endpoint.dialect is None


async def test_a_replica_that_publishes_kv_events_gets_their_url(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    cp.state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0, shards=[ShardAssignment(node="n1", device_numbers=[0])]
    )
    status = ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4000,
                           dialect=EngineDialect(kv_events=True))  # fmt: skip
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        await report_ok(client, url, token,
                        AgentReport(node="n1", inventory=inventory("h"), replicas=[status]))
    (endpoint,) = cp.gateways.config().routing.models[0].endpoints
    # The replica's own guard relays them, behind its engine key.
    assert endpoint.kv_events == f"{endpoint.url}/llmgw/kv-events"
