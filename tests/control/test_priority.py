"""Priority classes and teams' weights through the admin API on SQLite and PostgreSQL: on
teams and keys, a key's class over its team's, kept across a restart, and as the gateway
reads them."""

from __future__ import annotations

import httpx
from tests.control.planekit import bearer, opened_plane
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.gateway.checks.auth import KeyTable


async def test_classes_of_teams_and_keys(store_url: str) -> None:
    async with opened_plane(store_url) as (cp, creds), serve_asgi(create_app(cp)) as url:
        assert creds.admin_token
        admin = bearer(creds.admin_token)
        async with httpx.AsyncClient(base_url=url + "/admin/v1", headers=admin) as client:
            team = (await client.post("/teams", json={"name": "nightly", "priority": "batch"}))
            assert team.status_code == 201, team.text
            assert team.json()["priority"] == "batch"
            inherits = (await client.post("/keys", json={"team": "nightly"})).json()["key"]
            assert inherits["priority"] is None
            own = (await client.post("/keys", json={"team": "nightly",
                                                    "priority": "interactive"})).json()["key"]
            alone = (await client.post("/keys", json={})).json()["key"]
            refused = await client.post("/keys", json={"priority": "urgent"})
            assert refused.status_code == 422
            changed = await client.patch(f"/teams/{team.json()['team_id']}",
                                         json={"priority": "standard"})
            assert changed.json()["priority"] == "standard"
            moved = await client.patch(f"/keys/{alone['key_id']}", json={"priority": "batch"})
            assert moved.json()["priority"] == "batch"
            await client.patch(f"/teams/{team.json()['team_id']}", json={"priority": "batch"})
            weighed = await client.patch(f"/teams/{team.json()['team_id']}", json={"weight": 3})
            assert weighed.json()["weight"] == 3 and weighed.json()["priority"] == "batch"
            assert (await client.patch(f"/teams/{team.json()['team_id']}",
                                       json={"weight": None})).status_code == 422
            assert (await client.post("/teams", json={"name": "x", "weight": 0})
                    ).status_code == 422
        config = cp.gateways.config()
    # As the gateway ranks them: a key's own class, else its team's, else standard.
    table = KeyTable(config.keys, config.teams)
    ranks = {key_id: table.by_id[key_id].rank
             for key_id in (inherits["key_id"], own["key_id"], alone["key_id"])}
    assert ranks == {inherits["key_id"]: 2, own["key_id"]: 0, alone["key_id"]: 2}
    tenants = {table.by_id[k].tenant for k in (inherits["key_id"], own["key_id"])}
    assert tenants == {f"team:{team.json()['team_id']}"}, "a team shares its class as one"
    weights = {table.by_id[k].weight for k in (inherits["key_id"], own["key_id"])}
    assert weights == {3.0} and table.by_id[alone["key_id"]].weight == 1.0
    # Kept in the store: a control plane started again reads the same classes.
    async with opened_plane(store_url) as (again, _):
        classes = {k.key_id: k.priority for k in again.keys.all()}
        assert classes[own["key_id"]] == "interactive" and classes[alone["key_id"]] == "batch"
        assert [(t.priority, t.weight) for t in again.teams.all()] == [("batch", 3.0)]
