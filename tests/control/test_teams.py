"""Teams through the admin API on SQLite and PostgreSQL: made, changed, listed, deleted;
keys in a team; usage per team with its spend; all of it kept across a restart."""

from __future__ import annotations

import time

import httpx
from tests.control.planekit import bearer, opened_plane
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.wire import ModelPrice, ModelSpec, UsageRecord


async def test_teams_and_their_keys_live_in_the_store(store_url: str) -> None:
    async with opened_plane(store_url) as (cp, creds), serve_asgi(create_app(cp)) as url:
        assert creds.admin_token
        admin = bearer(creds.admin_token)
        async with httpx.AsyncClient(base_url=url + "/admin/v1", headers=admin) as client:
            made = await client.post("/teams", json={
                "name": "research", "models": ["m1"], "rpm": 60, "tpm": 1000,
                "tokens_per_day": 10_000, "tokens_per_month": 200_000, "budget_usd": 25.0})
            assert made.status_code == 201, made.text
            team = made.json()
            assert team["name"] == "research" and team["rpm"] == 60 and team["keys"] == 0
            clash = await client.post("/teams", json={"name": "research"})
            assert clash.status_code == 422 and "exists already" in clash.text

            key = await client.post("/keys", json={"name": "k1", "team": "research",
                                                   "tokens_per_day": 500})
            assert key.status_code == 201, key.text
            key_id = key.json()["key"]["key_id"]
            assert key.json()["key"]["team_id"] == team["team_id"]
            assert key.json()["key"]["tokens_per_day"] == 500
            unknown = await client.post("/keys", json={"team": "nobody"})
            assert unknown.status_code == 404

            same = await client.patch(f"/teams/{team['team_id']}", json={})
            assert same.status_code == 200 and same.json()["rpm"] == 60
            assert (await client.patch(f"/keys/{key_id}", json={})).status_code == 200
            changed = await client.patch(f"/teams/{team['team_id']}",
                                         json={"rpm": None, "budget_usd": 30.0,
                                               "budget_period": "week"})
            assert changed.status_code == 200, changed.text
            assert changed.json()["rpm"] is None and changed.json()["budget_usd"] == 30.0
            assert changed.json()["keys"] == 1
            listed = (await client.get("/keys", params={"team": "research"})).json()
            assert [k["key_id"] for k in listed] == [key_id]

            # A team with live keys stays; the key moved to the operator, it goes.
            refused = await client.delete("/teams/research")
            assert refused.status_code == 422 and "live key" in refused.text
            moved = await client.patch(f"/keys/{key_id}", json={"team": None, "rpm": 5})
            assert moved.json()["team_id"] is None and moved.json()["rpm"] == 5
            await client.patch(f"/keys/{key_id}", json={"team": "research"})

            # The gateways' config carries the teams and the keys' teams.
            config = cp.gateways.config()
            assert [t.name for t in config.teams] == ["research"]
            assert next(k for k in config.keys if k.key_id == key_id).team_id == team["team_id"]

            # Usage rows carry the team and the spend at the catalog's price.
            await cp.catalog.put([ModelSpec(
                name="m1", engine="sim", price=ModelPrice(input_per_million=2.0,
                                                         output_per_million=10.0))])
            minute = int(time.time()) // 60 * 60
            await cp.gateways.record_usage([UsageRecord(
                minute=minute, key_id=key_id, model="m1", requests=2, prompt_tokens=1000,
                completion_tokens=500)])
            report = (await client.get("/usage/report", params={"by": "team"})).json()
            assert report["rows"][0]["team_name"] == "research"
            assert abs(report["rows"][0]["spend_usd"] - 0.007) < 1e-9
            per_team = (await client.get("/usage", params={"team": "research"})).json()
            assert per_team["total"]["requests"] == 2
            csv = await client.get("/usage/report", params={"by": "team,model", "format": "csv"})
            assert csv.text.splitlines()[0].startswith("team_id,team_name,model,requests")

    async with opened_plane(store_url) as (again, _):
        assert [t.name for t in again.teams.all()] == ["research"]
        kept = again.teams.get("research")
        assert kept.budget_period == "week" and kept.tokens_per_day == 10_000
        assert again.keys.get(key_id).team_id == kept.team_id
        assert await again.store.consumed(since=0, team_id=kept.team_id) == (1500, 0.007)
