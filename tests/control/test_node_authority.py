"""Node authority: a node token speaks for its own node, names and addresses
are checked, and join tokens expire, run out and can be revoked (issue 13)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.control.planekit import KEY, Plane, bearer, inventory, register, send_report

from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.rows import replica_row
from llmgw.control.services.credentials import JOIN_HASH
from llmgw.control.state import ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.errors import AuthError
from llmgw.secrets import hash_secret
from llmgw.wire import AgentReport, ModelSpec, ReplicaState, ReplicaStatus, ShardAssignment


async def _report(client: httpx.AsyncClient, url: str, token: str, **fields: Any) -> httpx.Response:
    body = {"node": fields.pop("node"), "inventory": inventory("h").model_dump(mode="json"),
            **fields}
    return await send_report(client, url, token, body)


async def test_a_node_cannot_fail_or_refuse_another_nodes_replicas(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    replica = ReplicaRecord(id="r1", model="m", created_at=0.0, state=ReplicaState.READY,
                            port=4000, shards=[ShardAssignment(node="n1", device_numbers=[0])])
    other = ReplicaRecord(id="r2", model="m", created_at=0.0,
                          shards=[ShardAssignment(node="n1", device_numbers=[1])])
    for r in (replica, other):
        cp.state.replicas[r.id] = r
    await cp.store.write_replicas([replica_row(replica), replica_row(other)])
    async with httpx.AsyncClient() as client:
        await register(client, url, creds.join_token, "n1")
        rogue = await register(client, url, creds.join_token, "n2")
        failed = ReplicaStatus(replica_id="r1", state=ReplicaState.FAILED, reason="rogue")
        ready = ReplicaStatus(replica_id="r2", state=ReplicaState.READY, port=6666)
        for _ in range(2):
            answer = await _report(client, url, rogue, node="n2",
                                   replicas=[failed.model_dump(mode="json"),
                                             ready.model_dump(mode="json")],
                                   refused={"r1": "rogue refusal", "r2": "x"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["assignments"] == []
        events = await cp.store.list_events(kind="node", subject="n2")
    assert cp.state.replicas["r1"].state == ReplicaState.READY
    assert cp.state.replicas["r1"].port == 4000
    assert cp.state.replicas["r2"].state == ReplicaState.STARTING
    assert cp.state.replicas["r2"].port is None
    assert cp.state.nodes["n2"].refused == {} and cp.state.nodes["n2"].statuses == {}
    rows = {r["id"]: r for r in await cp.store.list_replicas()}
    assert rows["r1"]["state"] == "ready"
    # One event for the set, not one per report.
    ignored = [e for e in events if "not assigned" in e["message"]]
    assert len(ignored) == 1 and ignored[0]["data"]["replicas"] == ["r1", "r2"]


@pytest.mark.parametrize("name", ["[bold]x", "a/b", "x y", "-rf", "", "a" * 200, "n\n1",
                                  "[link=http://evil]n[/link]"])
async def test_registration_refuses_unsafe_node_names(plane: Plane, name: str) -> None:
    _, creds, url = plane
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{url}/agent/v1/register", json={"node": name},
                                   headers={"Authorization": f"Bearer {creds.join_token}"})
    assert answer.status_code == 422, answer.text
    assert "node" in answer.json()["error"]["message"]


NOT_HOSTS = ["http://evil.example", "user@10.0.0.5", "10.0.0.5/x", "10.0.0.5:9000",
             "evil.example:80", "", "a b", "[::1]", "host#frag", "[red]x"]
BAD_FABRICS = [["ib/a"], ["[red]f"], ["ok", "x y"], [f"f{i}" for i in range(17)]]


@pytest.mark.parametrize(("field", "value", "named"), [
    *(("address", address, "address") for address in NOT_HOSTS),
    *(("fabrics", fabrics, "fabric") for fabrics in BAD_FABRICS),
])
async def test_reports_refuse_addresses_that_are_not_hosts_and_bad_fabrics(
    plane: Plane, field: str, value: object, named: str,
) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        answer = await _report(client, url, token, node="n1", **{field: value})
    assert answer.status_code == 422, answer.text
    assert named in answer.json()["error"]["message"]
    node = cp.state.nodes["n1"]
    assert node.address == "127.0.0.1" and node.reported_fabrics == []


@pytest.mark.parametrize("address", ["10.0.0.5", "::1", "fe80::1", "gpu-01.example.com",
                                     "localhost"])
async def test_reports_accept_hosts_and_ips(plane: Plane, address: str) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.catalog.put([ModelSpec(name="m", engine="sim")])
    replica = ReplicaRecord(id="r1", model="m", created_at=0.0,
                            shards=[ShardAssignment(node="n1", device_numbers=[0])])
    cp.state.replicas["r1"] = replica
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        status = ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4321)
        answer = await _report(client, url, token, node="n1", address=address,
                               replicas=[status.model_dump(mode="json")])
    assert answer.status_code == 200, answer.text
    endpoint = cp.gateways.config().routing.models[0].endpoints[0].url
    host = f"[{address}]" if ":" in address else address
    assert endpoint == f"http://{host}:4321"
    assert httpx.URL(endpoint).port == 4321


# -- join tokens ---------------------------------------------------------------------


async def _admin(client: httpx.AsyncClient, creds: NewCredentials, method: str, url: str,
                 **kw: Any) -> httpx.Response:
    assert creds.admin_token
    return await client.request(method, url, headers=bearer(creds.admin_token), **kw)


async def _register_status(client: httpx.AsyncClient, url: str, join: str, node: str,
                           agent_key: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"node": node}
    if agent_key:
        body["agent_key"] = agent_key
    return await client.post(f"{url}/agent/v1/register", json=body,
                             headers={"Authorization": f"Bearer {join}"})


async def test_the_first_join_token_expires(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    (first,) = cp.credentials.join_tokens.tokens.values()
    assert first.expires_at is not None
    assert 23 * 3600 < first.expires_at - time.time() <= 24 * 3600
    first.expires_at = time.time() - 1
    async with httpx.AsyncClient() as client:
        answer = await _register_status(client, url, creds.join_token, "n1")
    assert answer.status_code == 401
    assert f"join token {first.id} expired" in answer.json()["error"]["message"]
    assert creds.join_token not in answer.text
    assert "n1" not in cp.state.nodes


async def test_single_use_revoked_and_listed_join_tokens(plane: Plane) -> None:
    cp, creds, url = plane
    async with httpx.AsyncClient() as client:
        made = await _admin(client, creds, "POST", f"{url}/admin/v1/join-tokens",
                            json={"uses": 1, "ttl_s": 600, "description": "rack 7"})
        assert made.status_code == 201, made.text
        once, view = made.json()["join_token"], made.json()["token"]
        assert view["max_uses"] == 1 and view["usable"] and "hash" not in view
        assert (await _register_status(client, url, once, "n1", KEY)).status_code == 200
        second = await _register_status(client, url, once, "n2")
        assert second.status_code == 401
        assert "already used 1 time" in second.json()["error"]["message"]
        # The node's own agent, whose answer was lost, may still register again.
        again = await _register_status(client, url, once, "n1", KEY)
        assert again.status_code == 200, again.text

        forever = (await _admin(client, creds, "POST", f"{url}/admin/v1/join-tokens",
                                json={"ttl_s": 0})).json()
        assert forever["token"]["expires_at"] is None
        revoked = await _admin(client, creds, "DELETE",
                               f"{url}/admin/v1/join-tokens/{forever['token']['id']}")
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        refused = await _register_status(client, url, forever["join_token"], "n3")
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
        # The first token is untouched by either.
        assert creds.join_token
        assert (await _register_status(client, url, creds.join_token, "n4")).status_code == 200

        listing = (await _admin(client, creds, "GET", f"{url}/admin/v1/join-tokens")).json()
        assert {t["description"] for t in listing} == {"first", "rack 7", ""}
        assert all("hash" not in t for t in listing)
        unknown = await _admin(client, creds, "DELETE", f"{url}/admin/v1/join-tokens/nope")
        assert unknown.status_code == 404
        # Node tokens and join tokens do not work on these routes.
        assert (await client.get(f"{url}/admin/v1/join-tokens",
                                 headers=bearer(creds.join_token))).status_code == 401
    # Kept across a restart: uses and revocations are in the store.
    reloaded = ControlPlane(cp.store)
    await reloaded.load()
    by_id = reloaded.credentials.join_tokens.tokens
    assert by_id[view["id"]].uses == 1
    assert by_id[forever["token"]["id"]].revoked


async def test_rotation_revokes_every_other_join_token(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    new = await cp.credentials.rotate_join_token()
    async with httpx.AsyncClient() as client:
        assert (await _register_status(client, url, creds.join_token, "n1")).status_code == 401
        assert (await _register_status(client, url, new, "n1")).status_code == 200


async def test_a_store_from_before_join_token_ids_keeps_its_token(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    try:
        await store.set_setting(JOIN_HASH, hash_secret("llmgw-join-old"))
        cp = ControlPlane(store)
        await cp.load()
        created = await cp.ensure_credentials()
        assert created.join_token is None  # not replaced behind the operator's back
        assert cp.credentials.join_tokens.check("llmgw-join-old", time.time()).id == "legacy"
        await cp.credentials.rotate_join_token()
        with pytest.raises(AuthError):
            cp.credentials.join_tokens.check("llmgw-join-old", time.time())
    finally:
        await store.close()


def test_agent_report_checks_its_own_fields() -> None:
    with pytest.raises(ValueError, match="host name or IP"):
        AgentReport(node="n1", inventory=inventory("h"), address="http://x")


async def test_unknown_node_tokens_cost_no_pass_over_the_fleet(plane: Plane) -> None:
    # Each token the index does not know used to rebuild it from every node:
    # whoever sends random tokens made the control plane walk the fleet.
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        tokens = [await register(client, url, plane.join, f"n{i}") for i in range(3)]
    assert cp.nodes.for_token(tokens[0]).name == "n0"
    with pytest.raises(AuthError):
        cp.nodes.for_token("llmgw-node-unknown")  # indexes once: the count changed
    index = cp.nodes._node_by_token_hash
    for n in range(50):
        with pytest.raises(AuthError):
            cp.nodes.for_token(f"llmgw-node-unknown-{n}")
    assert cp.nodes._node_by_token_hash is index  # not built again
    assert [cp.nodes.for_token(t).name for t in tokens] == ["n0", "n1", "n2"]
