"""The agent API over real HTTP: registration, reports, assignments, credentials."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from tests.control.planekit import (
    KEY,
    OTHER_KEY,
    Plane,
    bearer,
    inventory,
    register,
    report_ok,
    send_report,
)

from llmgw.control import telemetry
from llmgw.control.plane import ControlPlane
from llmgw.control.rows import replica_row
from llmgw.control.state import ReplicaRecord
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


async def _replica_on_n1(cp: ControlPlane) -> None:
    """Replica r1 of model m (already in the catalog) on n1, in memory and in the store."""
    replica = ReplicaRecord(id="r1", model="m", created_at=0.0,
                            shards=[ShardAssignment(node="n1", device_numbers=[0])])
    cp.state.replicas["r1"] = replica
    await cp.store.write_replicas([replica_row(replica)])


async def _register_refused(client: httpx.AsyncClient, plane: Plane, node: str,
                            **body: str) -> httpx.Response:
    answer = await client.post(f"{plane.url}/agent/v1/register", json={"node": node, **body},
                               headers={"Authorization": f"Bearer {plane.join}"})
    assert answer.status_code == 422, answer.text
    return answer


async def test_register_report_and_assignment(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        report = AgentReport(node="n1", inventory=inventory("n1"), fabrics=["f1"])
        answer = await report_ok(client, url, token, report)
        assert answer.json()["assignments"] == []
        node = cp.state.nodes["n1"]
        # A report only proposes fabrics (serve --trust-reported-fabrics aside).
        assert node.fabrics == [] and node.reported_fabrics == ["f1"]
        assert node.inventory == report.inventory

        await _replica_on_n1(cp)
        answer = await send_report(client, url, token, report)
        assignments = answer.json()["assignments"]
        assert [a["replica_id"] for a in assignments] == ["r1"]
        assert assignments[0]["model"]["name"] == "m"

        ready = report.model_copy(update={"replicas": [
            ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4321)]})
        await send_report(client, url, token, ready)
        assert cp.state.replicas["r1"].state == ReplicaState.READY
        route = cp.gateways.config().routing.models[0]
        assert [e.url for e in route.endpoints] == ["http://127.0.0.1:4321"]
        # The store has it too: a restart would route the same.
        rows = await cp.store.list_replicas()
        assert rows[0]["state"] == "ready" and rows[0]["port"] == 4321


async def test_a_ready_replica_shows_its_failing_probe_then_fails_when_hung(
    plane: Plane,
) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    await _replica_on_n1(cp)
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")

        async def report(state: ReplicaState, reason: str | None) -> None:
            status = ReplicaStatus(replica_id="r1", state=state, port=4321, reason=reason)
            await report_ok(client, url, token,
                            AgentReport(node="n1", inventory=inventory("n1"), replicas=[status]))

        async def shown() -> tuple[str, str | None]:
            (view,) = (await client.get(f"{url}/admin/v1/replicas", headers=plane.admin)).json()
            return view["state"], view["reason"]

        await report(ReplicaState.READY, None)
        assert await shown() == ("ready", None)
        # The agent's liveness probe fails, not yet for long: still routed to,
        # and `llmgw ctl replicas` says why it may not be for long.
        failing = "health probe /health failing since 12:00:00 UTC (1 probe failed in a row, ..."
        await report(ReplicaState.READY, failing)
        assert await shown() == ("ready", failing)
        assert cp.gateways.config().routing.models[0].endpoints
        await report(ReplicaState.READY, None)  # it answered again
        assert await shown() == ("ready", None)
        # Hung for good: killed by the agent, failed here like any failed
        # replica (the reconciler replaces it) and routed to no more.
        hung = "engine stopped answering /health for 35 s (...); killed; last output: ..."
        await report(ReplicaState.FAILED, hung)
        assert await shown() == ("failed", hung)
        assert not cp.gateways.config().routing.models[0].endpoints
        (row,) = await cp.store.list_replicas()
        assert (row["state"], row["reason"]) == ("failed", hung)


async def test_credentials_are_not_interchangeable(plane: Plane) -> None:
    _, creds, url = plane
    assert creds.join_token and creds.admin_token and creds.api_key
    async with httpx.AsyncClient() as client:
        bad = await client.post(f"{url}/agent/v1/register", json={"node": "n1"},
                                headers={"Authorization": f"Bearer {creds.admin_token}"})
        assert bad.status_code == 401
        assert bad.json()["error"]["type"] == "authentication_error"
        token_1 = await register(client, url, creds.join_token, "n1")
        await register(client, url, creds.join_token, "n2")
        # Registering the same name twice is refused: a join token buys one token per node.
        await _register_refused(client, plane, "n1")
        # A node token speaks only for its node.
        other = AgentReport(node="n2", inventory=inventory("n2"))
        assert (await send_report(client, url, token_1, other)).status_code == 403
        for wrong in (creds.admin_token, creds.api_key, "nonsense"):
            assert (await send_report(client, url, wrong, other)).status_code == 401
        # Gateway routes take the gateway (or admin) token, never a node token or API key.
        for wrong in (token_1, creds.api_key):
            answer = await client.get(f"{url}/gateway/v1/config?wait=0", headers=bearer(wrong))
            assert answer.status_code == 401
        assert creds.gateway_token
        ok = await client.get(f"{url}/gateway/v1/config?wait=0",
                              headers=bearer(creds.gateway_token))
        assert ok.status_code == 200 and "routing" in ok.json()


async def test_malformed_report_is_refused_and_changes_nothing(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        before = await cp.store.list_nodes()
        for body in (b"{not json", b'{"node": "n1"}', b'{"node": "n1", "inventory": 5}',
                     b'{"node": "n1", "inventory": {"hostname": "x"}, "surprise": 1}'):
            answer = await send_report(client, url, token, body)
            assert answer.status_code == 422, body
            assert answer.json()["error"]["message"]
        assert await cp.store.list_nodes() == before
        assert cp.state.nodes["n1"].last_seen is None


async def test_watch_config_wakes_on_change(plane: Plane) -> None:
    cp, creds, url = plane
    version = cp.state.routing_version
    assert creds.gateway_token
    async with httpx.AsyncClient(timeout=10) as client:
        waiting = asyncio.create_task(client.get(
            f"{url}/gateway/v1/config?after={version}&wait=5", headers=bearer(creds.gateway_token),
        ))
        # A while for the watch to reach the server and park there: it must not answer
        # before anything changed.
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await cp.catalog.put([ModelSpec(name="late", engine="sim")])
        answer = await asyncio.wait_for(waiting, 2)
        assert [m["name"] for m in answer.json()["routing"]["models"]] == ["late"]


async def test_unknown_paths_answer_in_the_error_shape(plane: Plane) -> None:
    async with httpx.AsyncClient() as client:
        for path in ("/nothing-here", "/admin/v1/no-such-resource", "/agent/v1/nope"):
            answer = await client.get(f"{plane.url}{path}")
            assert answer.status_code in (401, 404), path
            assert set(answer.json()["error"]) >= {"message", "type"}, answer.text
        wrong_method = await client.get(f"{plane.url}/agent/v1/report")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_telemetry_alone_is_not_written_to_the_store(plane: Plane) -> None:
    cp, _, url = plane
    writes: list[str] = []
    real_replace = cp.store.replace_gpus

    async def counting_replace(node: str, rows: list[dict[str, object]], **fence: Any) -> None:
        writes.append(node)
        await real_replace(node, rows, **fence)

    cp.store.replace_gpus = counting_replace  # type: ignore[method-assign]
    gpu = Device(number=0, label="0", uuid="GPU-1", name="NVIDIA H100", gpu_class="h100-80g",
                 memory_total_mib=81559, temperature_c=40)

    def report(device: Device) -> AgentReport:
        return AgentReport(node="n1", inventory=NodeInventory(hostname="n1", devices=[device]))

    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        for temperature in (41, 42, 43):
            await report_ok(client, url, token,
                            report(gpu.model_copy(update={"temperature_c": temperature})))
            if temperature == 41:
                first_inventory = cp.state.nodes["n1"].inventory
        assert writes == ["n1"]  # the first report; the rest only warmed the card
        node = cp.state.nodes["n1"]
        # The readings are taken beside the inventory, which stays the same object.
        assert node.inventory is first_inventory
        readings = telemetry.current(node.inventory, node.readings)
        assert readings is not None and readings.of(0) == (0, None, 43, None)
        sick = gpu.model_copy(update={"healthy": False, "unhealthy_reasons": ["ECC"]})
        await send_report(client, url, token, report(sick))
        assert writes == ["n1", "n1"]
        assert (await cp.store.list_gpus("n1"))[0]["healthy"] is False


async def post_report(
    client: httpx.AsyncClient, url: str, token: str, node: str, key_hash: str | None = None
) -> int:
    report = AgentReport(node=node, inventory=inventory(node), agent_key_hash=key_hash)
    return (await send_report(client, url, token, report)).status_code


async def test_the_same_agent_registers_again_and_the_node_keeps_its_state(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    async with httpx.AsyncClient() as client:
        first = await register(client, url, plane.join, "n1", agent_key=KEY)
        assert await post_report(client, url, first, "n1") == 200
        await cp.nodes.set_state("n1", NodeState.CORDONED)
        await _replica_on_n1(cp)
        gpus_before = await cp.store.list_gpus("n1")

        # The answer to the first registration never arrived: the agent asks again.
        second = await register(client, url, plane.join, "n1", agent_key=KEY)
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
    assert restarted.nodes.for_token(second).name == "n1"
    with pytest.raises(AuthError):
        restarted.nodes.for_token(first)


async def test_another_or_no_agent_key_is_refused_with_what_to_do(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1", agent_key=KEY)
        row_before = await cp.store.list_nodes()
        for body, why in (
            ({"agent_key": OTHER_KEY}, "not the one it registered with"),
            ({}, "carries no agent key"),
        ):
            answer = await _register_refused(client, plane, "n1", **body)
            message = answer.json()["error"]["message"]
            assert why in message and "llmgw ctl nodes delete n1" in message
            assert OTHER_KEY not in answer.text and KEY not in answer.text
        # The right key is no use without the join token.
        stolen = await client.post(f"{url}/agent/v1/register",
                                   json={"node": "n1", "agent_key": KEY},
                                   headers={"Authorization": "Bearer llmgw-join-guess"})
        assert stolen.status_code == 401
        # Refusals changed nothing: the running agent keeps its token.
        assert await cp.store.list_nodes() == row_before
        assert await post_report(client, url, token, "n1") == 200
        # What the message says to do works: deleted, the node registers anew,
        # under the new agent's key.
        deleted = await client.delete(f"{url}/admin/v1/nodes/n1", headers=plane.admin)
        assert deleted.status_code == 200, deleted.text
        fresh = await register(client, url, plane.join, "n1", agent_key=OTHER_KEY)
        assert await post_report(client, url, fresh, "n1") == 200
        await register(client, url, plane.join, "n1", agent_key=OTHER_KEY)
        await _register_refused(client, plane, "n1", agent_key=KEY)


async def test_a_node_registered_without_an_agent_key_keeps_the_old_rule(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        await register(client, url, plane.join, "old")  # an agent from before agent keys
        assert cp.state.nodes["old"].agent_key_hash is None
        for body in ({}, {"agent_key": KEY}):
            answer = await _register_refused(client, plane, "old", **body)
            message = answer.json()["error"]["message"]
            assert "before agents sent an agent key" in message
            assert "llmgw ctl nodes delete old" in message


async def test_a_short_agent_key_is_refused(plane: Plane) -> None:
    async with httpx.AsyncClient() as client:
        answer = await _register_refused(client, plane, "n1", agent_key="short-secret")
    message = answer.json()["error"]["message"]
    assert "agent_key" in message and "32 characters" in message
    assert "short-secret" not in message
    assert "n1" not in plane.cp.state.nodes


async def test_a_node_registered_without_an_agent_key_gets_one_from_a_report(
    plane: Plane,
) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "old")  # from before agent keys
        assert await post_report(client, url, token, "old") == 200  # an agent that sends none
        assert cp.state.nodes["old"].agent_key_hash is None
        assert await post_report(client, url, token, "old", key_hash=hash_secret(KEY)) == 200
        assert cp.state.nodes["old"].agent_key_hash == hash_secret(KEY)
        [row] = await cp.store.list_nodes()
        assert row["agent_key_hash"] == hash_secret(KEY)  # in the store, not only in memory
        messages = [e["message"] for e in await cp.store.list_events(subject="old")]
        assert any("recorded its agent's key" in m for m in messages), messages
        # What it is for: the agent whose registration answer is lost gets back in.
        again = await register(client, url, plane.join, "old", agent_key=KEY)
        assert await post_report(client, url, again, "old") == 200


async def test_a_report_never_replaces_a_nodes_agent_key(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1", agent_key=KEY)
        assert await post_report(client, url, token, "n1", key_hash=hash_secret(OTHER_KEY)) == 200
        assert cp.state.nodes["n1"].agent_key_hash == hash_secret(KEY)
        [row] = await cp.store.list_nodes()
        assert row["agent_key_hash"] == hash_secret(KEY)
        # The registration still follows the first key, not the reported one.
        await _register_refused(client, plane, "n1", agent_key=OTHER_KEY)
        messages = [e["message"] for e in await cp.store.list_events(subject="n1")]
        assert not any("recorded its agent's key" in m for m in messages), messages


async def test_a_report_with_a_malformed_agent_key_hash_is_refused(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "old")
        body = AgentReport(node="old", inventory=inventory("old")).model_dump(mode="json")
        body["agent_key_hash"] = KEY  # the key itself, not its hash
        answer = await send_report(client, url, token, body)
    assert answer.status_code == 422
    assert "agent_key_hash" in answer.json()["error"]["message"]
    assert KEY not in answer.text
    assert cp.state.nodes["old"].agent_key_hash is None
