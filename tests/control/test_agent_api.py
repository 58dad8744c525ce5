"""The agent API over real HTTP: registration, reports, assignments, credentials."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.rows import replica_row
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.control.state import ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.errors import AuthError
from llmgw.secrets import hash_secret
from llmgw.wire import (
    AgentReport,
    Device,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
)


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, NewCredentials, str]]:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    async with serve_asgi(create_app(cp)) as url:
        yield cp, creds, url
    await store.close()


def inventory(host: str) -> NodeInventory:
    return NodeInventory(
        hostname=host,
        devices=[Device(number=0, label="cpu0", uuid=f"CPU-{host}-0", name="cpu", gpu_class="cpu")],
    )


async def register(
    client: httpx.AsyncClient, url: str, join: str, node: str, agent_key: str | None = None
) -> str:
    body = {"node": node, "join_token": join}
    if agent_key is not None:
        body["agent_key"] = agent_key
    answer = await client.post(f"{url}/agent/v1/register", json=body)
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["node_token"]
    return token


KEY = "llmgw-agent-key-" + "k" * 43
OTHER_KEY = "llmgw-agent-key-" + "o" * 43


async def test_register_report_and_assignment(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.put_models([ModelSpec(name="m", engine="sim")])
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        report = AgentReport(node="n1", inventory=inventory("n1"), fabrics=["f1"])
        answer = await client.post(
            f"{url}/agent/v1/report", content=report.model_dump_json(),
            headers={"Authorization": f"Bearer {token}"},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["assignments"] == []
        node = cp.state.nodes["n1"]
        # A report only proposes fabrics (serve --trust-reported-fabrics aside).
        assert node.fabrics == [] and node.reported_fabrics == ["f1"]
        assert node.inventory == report.inventory

        replica = ReplicaRecord(id="r1", model="m", created_at=0.0,
                                shards=[ShardAssignment(node="n1", device_numbers=[0])])
        cp.state.replicas["r1"] = replica
        await cp.store.write_replicas([replica_row(replica)])
        answer = await client.post(
            f"{url}/agent/v1/report", content=report.model_dump_json(),
            headers={"Authorization": f"Bearer {token}"},
        )
        assignments = answer.json()["assignments"]
        assert [a["replica_id"] for a in assignments] == ["r1"]
        assert assignments[0]["model"]["name"] == "m"

        ready = report.model_copy(update={"replicas": [
            ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4321)]})
        await client.post(f"{url}/agent/v1/report", content=ready.model_dump_json(),
                          headers={"Authorization": f"Bearer {token}"})
        assert cp.state.replicas["r1"].state == ReplicaState.READY
        route = cp.gateway_config().routing.models[0]
        assert [e.url for e in route.endpoints] == ["http://127.0.0.1:4321"]
        # The store has it too: a restart would route the same.
        rows = await cp.store.list_replicas()
        assert rows[0]["state"] == "ready" and rows[0]["port"] == 4321


async def test_a_ready_replica_shows_its_failing_probe_then_fails_when_hung(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token and creds.admin_token
    await cp.put_models([ModelSpec(name="m", engine="sim")])
    replica = ReplicaRecord(id="r1", model="m", created_at=0.0,
                            shards=[ShardAssignment(node="n1", device_numbers=[0])])
    cp.state.replicas["r1"] = replica
    await cp.store.write_replicas([replica_row(replica)])
    admin = {"Authorization": f"Bearer {creds.admin_token}"}
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        agent = {"Authorization": f"Bearer {token}"}

        async def report(state: ReplicaState, reason: str | None) -> None:
            status = ReplicaStatus(replica_id="r1", state=state, port=4321, reason=reason)
            body = AgentReport(node="n1", inventory=inventory("n1"), replicas=[status])
            answer = await client.post(f"{url}/agent/v1/report",
                                       content=body.model_dump_json(), headers=agent)
            assert answer.status_code == 200, answer.text

        async def shown() -> tuple[str, str | None]:
            (view,) = (await client.get(f"{url}/admin/v1/replicas", headers=admin)).json()
            return view["state"], view["reason"]

        await report(ReplicaState.READY, None)
        assert await shown() == ("ready", None)
        # The agent's liveness probe fails, not yet for long: still routed to,
        # and `llmgw ctl replicas` says why it may not be for long.
        failing = "health probe /health failing since 12:00:00 UTC (1 probe failed in a row, ..."
        await report(ReplicaState.READY, failing)
        assert await shown() == ("ready", failing)
        assert cp.gateway_config().routing.models[0].endpoints
        await report(ReplicaState.READY, None)  # it answered again
        assert await shown() == ("ready", None)
        # Hung for good: killed by the agent, failed here like any failed
        # replica (the reconciler replaces it) and routed to no more.
        hung = "engine stopped answering /health for 35 s (...); killed; last output: ..."
        await report(ReplicaState.FAILED, hung)
        assert await shown() == ("failed", hung)
        assert not cp.gateway_config().routing.models[0].endpoints
        (row,) = await cp.store.list_replicas()
        assert (row["state"], row["reason"]) == ("failed", hung)


async def test_credentials_are_not_interchangeable(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    _, creds, url = plane
    assert creds.join_token and creds.admin_token and creds.api_key
    async with httpx.AsyncClient() as client:
        bad = await client.post(f"{url}/agent/v1/register",
                                json={"node": "n1", "join_token": creds.admin_token})
        assert bad.status_code == 401
        assert bad.json()["error"]["type"] == "authentication_error"
        token_1 = await register(client, url, creds.join_token, "n1")
        await register(client, url, creds.join_token, "n2")
        # Registering the same name twice is refused: a join token buys one token per node.
        again = await client.post(f"{url}/agent/v1/register",
                                  json={"node": "n1", "join_token": creds.join_token})
        assert again.status_code == 422
        # A node token speaks only for its node.
        other = AgentReport(node="n2", inventory=inventory("n2"))
        answer = await client.post(f"{url}/agent/v1/report", content=other.model_dump_json(),
                                   headers={"Authorization": f"Bearer {token_1}"})
        assert answer.status_code == 403
        for wrong in (creds.admin_token, creds.api_key, "nonsense"):
            answer = await client.post(
                f"{url}/agent/v1/report", content=other.model_dump_json(),
                headers={"Authorization": f"Bearer {wrong}"},
            )
            assert answer.status_code == 401
        # Gateway routes take the gateway (or admin) token, never a node token or API key.
        for wrong in (token_1, creds.api_key):
            answer = await client.get(f"{url}/gateway/v1/config?wait=0",
                                      headers={"Authorization": f"Bearer {wrong}"})
            assert answer.status_code == 401
        assert creds.gateway_token
        ok = await client.get(f"{url}/gateway/v1/config?wait=0",
                              headers={"Authorization": f"Bearer {creds.gateway_token}"})
        assert ok.status_code == 200 and "routing" in ok.json()


async def test_malformed_report_is_refused_and_changes_nothing(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        before = await cp.store.list_nodes()
        for body in (b"{not json", b'{"node": "n1"}', b'{"node": "n1", "inventory": 5}',
                     b'{"node": "n1", "inventory": {"hostname": "x"}, "surprise": 1}'):
            answer = await client.post(f"{url}/agent/v1/report", content=body,
                                       headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == 422, body
            assert answer.json()["error"]["message"]
        assert await cp.store.list_nodes() == before
        assert cp.state.nodes["n1"].last_seen is None


async def test_watch_config_wakes_on_change(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    import asyncio

    cp, creds, url = plane
    version = cp.state.routing_version
    async with httpx.AsyncClient(timeout=10) as client:
        waiting = asyncio.create_task(client.get(
            f"{url}/gateway/v1/config?after={version}&wait=5",
            headers={"Authorization": f"Bearer {creds.gateway_token}"},
        ))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await cp.put_models([ModelSpec(name="late", engine="sim")])
        answer = await asyncio.wait_for(waiting, 2)
        assert [m["name"] for m in answer.json()["routing"]["models"]] == ["late"]


async def test_unknown_paths_answer_in_the_error_shape(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    _, _, url = plane
    async with httpx.AsyncClient() as client:
        for path in ("/nothing-here", "/admin/v1/no-such-resource", "/agent/v1/nope"):
            answer = await client.get(f"{url}{path}")
            assert answer.status_code in (401, 404), path
            assert set(answer.json()["error"]) >= {"message", "type"}, answer.text
        wrong_method = await client.get(f"{url}/agent/v1/report")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_telemetry_alone_is_not_written_to_the_store(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    writes: list[str] = []
    real_replace = cp.store.replace_gpus

    async def counting_replace(node: str, rows: list[dict[str, object]], **fence: Any) -> None:
        writes.append(node)
        await real_replace(node, rows, **fence)

    cp.store.replace_gpus = counting_replace  # type: ignore[method-assign]
    gpu = Device(number=0, label="0", uuid="GPU-1", name="NVIDIA H100", gpu_class="h100-80g",
                 memory_total_mib=81559, temperature_c=40)
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        headers = {"Authorization": f"Bearer {token}"}
        for temperature in (41, 42, 43):
            hot = gpu.model_copy(update={"temperature_c": temperature})
            report = AgentReport(node="n1", inventory=NodeInventory(hostname="n1", devices=[hot]))
            answer = await client.post(f"{url}/agent/v1/report",
                                       content=report.model_dump_json(), headers=headers)
            assert answer.status_code == 200
        assert writes == ["n1"]  # the first report; the rest only warmed the card
        inventory = cp.state.nodes["n1"].inventory
        assert inventory is not None and inventory.devices[0].temperature_c == 43
        sick = gpu.model_copy(update={"healthy": False, "unhealthy_reasons": ["ECC"]})
        report = AgentReport(node="n1", inventory=NodeInventory(hostname="n1", devices=[sick]))
        await client.post(f"{url}/agent/v1/report", content=report.model_dump_json(),
                          headers=headers)
        assert writes == ["n1", "n1"]
        assert (await cp.store.list_gpus("n1"))[0]["healthy"] is False


async def post_report(
    client: httpx.AsyncClient, url: str, token: str, node: str, key_hash: str | None = None
) -> int:
    report = AgentReport(node=node, inventory=inventory(node), agent_key_hash=key_hash)
    answer = await client.post(f"{url}/agent/v1/report", content=report.model_dump_json(),
                               headers={"Authorization": f"Bearer {token}"})
    return answer.status_code


async def test_the_same_agent_registers_again_and_the_node_keeps_its_state(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.put_models([ModelSpec(name="m", engine="sim")])
    async with httpx.AsyncClient() as client:
        first = await register(client, url, creds.join_token, "n1", agent_key=KEY)
        assert await post_report(client, url, first, "n1") == 200
        await cp.set_node_state("n1", NodeState.CORDONED)
        replica = ReplicaRecord(id="r1", model="m", created_at=0.0,
                                shards=[ShardAssignment(node="n1", device_numbers=[0])])
        cp.state.replicas["r1"] = replica
        await cp.store.write_replicas([replica_row(replica)])
        gpus_before = await cp.store.list_gpus("n1")

        # The answer to the first registration never arrived: the agent asks again.
        second = await register(client, url, creds.join_token, "n1", agent_key=KEY)
        assert second != first
        assert await post_report(client, url, first, "n1") == 401  # revoked
        assert await post_report(client, url, second, "n1") == 200
    node = cp.state.nodes["n1"]
    assert node.admin_state == NodeState.CORDONED
    assert "r1" in cp.state.replicas and await cp.store.list_gpus("n1") == gpus_before
    messages = [e["message"] for e in await cp.store.list_events(subject="n1")]
    assert any("registered again by its own agent" in m for m in messages), messages
    assert not any(KEY in m for m in messages)
    # Durable: after a restart the new token works and the old one does not.
    restarted = ControlPlane(cp.store)
    await restarted.load()
    assert restarted.node_for_token(second).name == "n1"
    with pytest.raises(AuthError):
        restarted.node_for_token(first)


async def test_another_or_no_agent_key_is_refused_with_what_to_do(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token and creds.admin_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1", agent_key=KEY)
        row_before = await cp.store.list_nodes()
        for body, why in (
            ({"agent_key": OTHER_KEY}, "not the one it registered with"),
            ({}, "carries no agent key"),
        ):
            answer = await client.post(f"{url}/agent/v1/register",
                                       json={"node": "n1", "join_token": creds.join_token, **body})
            assert answer.status_code == 422, answer.text
            message = answer.json()["error"]["message"]
            assert why in message and "llmgw ctl nodes delete n1" in message
            assert OTHER_KEY not in answer.text and KEY not in answer.text
        # The right key is no use without the join token.
        stolen = await client.post(f"{url}/agent/v1/register",
                                   json={"node": "n1", "join_token": "llmgw-join-guess",
                                         "agent_key": KEY})
        assert stolen.status_code == 401
        # Refusals changed nothing: the running agent keeps its token.
        assert await cp.store.list_nodes() == row_before
        assert await post_report(client, url, token, "n1") == 200
        # What the message says to do works: deleted, the node registers anew,
        # under the new agent's key.
        deleted = await client.delete(f"{url}/admin/v1/nodes/n1",
                                      headers={"Authorization": f"Bearer {creds.admin_token}"})
        assert deleted.status_code == 200, deleted.text
        fresh = await register(client, url, creds.join_token, "n1", agent_key=OTHER_KEY)
        assert await post_report(client, url, fresh, "n1") == 200
        await register(client, url, creds.join_token, "n1", agent_key=OTHER_KEY)
        again = await client.post(f"{url}/agent/v1/register",
                                  json={"node": "n1", "join_token": creds.join_token,
                                        "agent_key": KEY})
        assert again.status_code == 422


async def test_a_node_registered_without_an_agent_key_keeps_the_old_rule(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        await register(client, url, creds.join_token, "old")  # an agent from before agent keys
        assert cp.state.nodes["old"].agent_key_hash is None
        for body in ({}, {"agent_key": KEY}):
            answer = await client.post(f"{url}/agent/v1/register",
                                       json={"node": "old", "join_token": creds.join_token,
                                             **body})
            assert answer.status_code == 422, answer.text
            message = answer.json()["error"]["message"]
            assert "before agents sent an agent key" in message
            assert "llmgw ctl nodes delete old" in message


async def test_a_short_agent_key_is_refused(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{url}/agent/v1/register",
                                   json={"node": "n1", "join_token": creds.join_token,
                                         "agent_key": "short-secret"})
    assert answer.status_code == 422
    message = answer.json()["error"]["message"]
    assert "agent_key" in message and "32 characters" in message
    assert "short-secret" not in message
    assert "n1" not in cp.state.nodes


async def test_a_node_registered_without_an_agent_key_gets_one_from_a_report(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "old")  # from before agent keys
        assert await post_report(client, url, token, "old") == 200  # an agent that sends none
        assert cp.state.nodes["old"].agent_key_hash is None
        assert await post_report(client, url, token, "old", key_hash=hash_secret(KEY)) == 200
        assert cp.state.nodes["old"].agent_key_hash == hash_secret(KEY)
        [row] = await cp.store.list_nodes()
        assert row["agent_key_hash"] == hash_secret(KEY)  # in the store, not only in memory
        messages = [e["message"] for e in await cp.store.list_events(subject="old")]
        assert any("recorded its agent's key" in m for m in messages), messages
        # What it is for: the agent whose registration answer is lost gets back in.
        again = await register(client, url, creds.join_token, "old", agent_key=KEY)
        assert await post_report(client, url, again, "old") == 200


async def test_a_report_never_replaces_a_nodes_agent_key(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1", agent_key=KEY)
        assert await post_report(client, url, token, "n1", key_hash=hash_secret(OTHER_KEY)) == 200
        assert cp.state.nodes["n1"].agent_key_hash == hash_secret(KEY)
        [row] = await cp.store.list_nodes()
        assert row["agent_key_hash"] == hash_secret(KEY)
        # The registration still follows the first key, not the reported one.
        stolen = await client.post(f"{url}/agent/v1/register",
                                   json={"node": "n1", "join_token": creds.join_token,
                                         "agent_key": OTHER_KEY})
        assert stolen.status_code == 422
        messages = [e["message"] for e in await cp.store.list_events(subject="n1")]
        assert not any("recorded its agent's key" in m for m in messages), messages


async def test_a_report_with_a_malformed_agent_key_hash_is_refused(
    plane: tuple[ControlPlane, NewCredentials, str],
) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "old")
        body = AgentReport(node="old", inventory=inventory("old")).model_dump(mode="json")
        body["agent_key_hash"] = KEY  # the key itself, not its hash
        answer = await client.post(f"{url}/agent/v1/report", json=body,
                                   headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 422
    assert "agent_key_hash" in answer.json()["error"]["message"]
    assert KEY not in answer.text
    assert cp.state.nodes["old"].agent_key_hash is None
