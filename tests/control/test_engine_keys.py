"""Per-replica engine keys: made by the control plane, given to the node and the gateways only."""

from __future__ import annotations

import httpx
import pytest
from tests.control.planekit import Plane, inventory, register, report_ok

from llmgw.control.catalog import validate_catalog
from llmgw.control.enginekeys import EngineKeys
from llmgw.control.plane import ControlPlane
from llmgw.control.state import ReplicaRecord
from llmgw.errors import ValidationError
from llmgw.wire import (
    AgentReport,
    AgentReportAnswer,
    ModelSpec,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
)


def test_keys_are_distinct_per_replica_and_fixed_by_the_seed() -> None:
    keys = EngineKeys(b"s" * 32)
    assert keys.key("r1") == EngineKeys(b"s" * 32).key("r1")
    assert keys.key("r1") != keys.key("r2")
    assert keys.key("r1") != EngineKeys(b"t" * 32).key("r1")
    assert len(keys.key("r1")) == 43 and keys.key("r1").replace("-", "").replace("_", "").isalnum()
    # Without a stored seed, still random: two control planes never share keys by accident.
    assert EngineKeys().key("r1") != EngineKeys().key("r1")


async def test_the_node_and_the_gateways_get_the_key_and_no_admin_read_shows_it(
    plane: Plane,
) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    for rid, node in (("r1", "n1"), ("r2", "n2")):
        cp.state.replicas[rid] = ReplicaRecord(
            id=rid, model="m", created_at=0.0, shards=[ShardAssignment(node=node)]
        )
    async with httpx.AsyncClient() as client:
        tokens = {n: await register(client, url, plane.join, n) for n in ("n1", "n2")}

        async def report(node: str, rid: str) -> AgentReportAnswer:
            status = ReplicaStatus(replica_id=rid, state=ReplicaState.READY, port=4000)
            body = AgentReport(node=node, inventory=inventory(node), replicas=[status])
            answer = await report_ok(client, url, tokens[node], body)
            return AgentReportAnswer.model_validate_json(answer.content)

        (mine,) = (await report("n1", "r1")).assignments
        (theirs,) = (await report("n2", "r2")).assignments
        key = mine.engine_key
        assert key and theirs.engine_key and key != theirs.engine_key
        assert key not in repr(mine)  # a logged assignment never shows it
        # Each gateway endpoint carries its replica's key.
        endpoints = cp.gateways.config().routing.models[0].endpoints
        assert {e.replica_id: e.engine_key for e in endpoints} == {
            "r1": key, "r2": theirs.engine_key
        }  # fmt: skip
        for path in ("/summary", "/nodes", "/nodes/n1", "/replicas", "/replicas/r1", "/models",
                     "/models/m", "/events", "/plan"):  # fmt: skip
            read = await client.get(f"{url}/admin/v1{path}", headers=plane.admin)
            assert read.status_code == 200, (path, read.text)
            assert key not in read.text and theirs.engine_key not in read.text, path

    # Another instance on the same store (a restart, a standby taking over)
    # hands out the same key, so running engines and adopted ones keep theirs.
    again = ControlPlane(cp.store)
    await again.load()
    assert again.engine_keys.key("r1") == key


@pytest.mark.parametrize(
    ("engine", "name"),
    [("vllm", "VLLM_API_KEY"), ("sim", "LLMGW_ENGINE_KEY"), ("llamacpp", "API_KEY"),
     ("llamacpp", "LLAMA_API_KEY"), ("llamacpp", "api_key")],
)  # fmt: skip
def test_the_catalog_refuses_an_engine_key_in_env(engine: str, name: str) -> None:
    spec = ModelSpec.model_validate(
        {"name": "m", "engine": engine, "weights": {"kind": "hf", "repo": "org/m"},
         "env": {name: "mine"}}
    )  # fmt: skip
    with pytest.raises(ValidationError, match=f"env.{name}"):
        validate_catalog([spec])
    # Nor for another engine, whose setting it is not (llmgw.engine_env).
    other = "sim" if engine != "sim" else "vllm"
    with pytest.raises(ValidationError, match="setting a catalog may give"):
        validate_catalog([spec.model_copy(update={"engine": other})])
