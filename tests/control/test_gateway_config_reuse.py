"""The routing table reuses what did not change, and shows everything that did.

Gateways.config keeps each endpoint and each model's route from
the last table while what it was built from is unchanged (at 10,000
replicas, rebuilding every object on every change took most of the control
plane's CPU); a change to a replica, a node or a catalog entry must still
show in the next table, and nothing else may be built again.
"""

from __future__ import annotations

import time

from llmgw.control.plane import ControlPlane
from llmgw.control.state import NodeRecord, ReplicaRecord
from llmgw.wire import EngineDialect, ModelRoute, ModelSpec, ReplicaState, ShardAssignment


async def test_unchanged_routes_are_reused_and_changes_show(cp: ControlPlane) -> None:
    await cp.catalog.put([ModelSpec(name="a", engine="sim"), ModelSpec(name="b", engine="sim")])
    now = time.time()
    for name in ("n1", "n2"):
        cp.state.nodes[name] = NodeRecord(name=name, registered_at=now, last_seen=now,
                                          address=f"10.0.0.{name[-1]}")
    for rid, model, node, port in (("ra", "a", "n1", 4001), ("rb1", "b", "n1", 4002),
                                   ("rb2", "b", "n2", 4003)):
        cp.state.replicas[rid] = ReplicaRecord(
            id=rid, model=model, created_at=now, state=ReplicaState.READY, port=port,
            shards=[ShardAssignment(node=node, device_numbers=[0])])

    def table() -> dict[str, ModelRoute]:
        return {r.name: r for r in cp.gateways.config().routing.models}

    async def changed() -> dict[str, ModelRoute]:
        await cp.state.bump_routing()
        return table()

    first = table()
    assert [e.url for e in first["b"].endpoints] == [
        "http://10.0.0.1:4002", "http://10.0.0.2:4003"]
    again = await changed()
    assert again["a"] is first["a"] and again["b"] is first["b"]

    cp.state.replicas["ra"].port = 5001
    moved = await changed()
    assert moved["b"] is first["b"] and moved["a"] is not first["a"]
    assert [e.url for e in moved["a"].endpoints] == ["http://10.0.0.1:5001"]

    cp.state.replicas["rb1"].dialect = EngineDialect(stream_usage=False)
    mended = await changed()
    [rb1, rb2] = mended["b"].endpoints
    assert rb1.dialect == EngineDialect(stream_usage=False)
    assert rb2 is first["b"].endpoints[1]

    cp.state.nodes["n2"].last_seen = now - 3600  # unreachable: out of routing
    lost = await changed()
    assert [e.replica_id for e in lost["b"].endpoints] == ["rb1"]

    cp.state.models["a"].spec.aliases.append("alias-a")  # edited in place
    renamed = await changed()
    assert renamed["a"].aliases == ["alias-a"]

    cp.state.models["b"].parked, cp.state.models["b"].last_error = True, "boom"
    parked = await changed()
    assert parked["b"].parked and parked["b"].parked_reason == "boom"
