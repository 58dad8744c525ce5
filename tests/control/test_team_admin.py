"""A team admin (single sign-on's role) reaches its own team's keys, team and usage only."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from tests.control.planekit import opened_plane
from tests.servers import serve_asgi

from llmgw.control.access.door import Door
from llmgw.control.access.roles import ADMIN_TOKEN, Principal, Role
from llmgw.control.adminapi.routes import build_admin_router
from llmgw.control.httperrors import install_error_handlers
from llmgw.wire import TeamInfo, UsageRecord

LEAD = Principal(subject="tara", roles=frozenset({Role.TEAM_ADMIN}),
                 teams=frozenset({"research"}), via="session", name="tara@example.test")


class HeaderDoor(Door):
    """Who is asking, by a header: the admin token's powers or Tara's."""

    async def principal(self, request: Request) -> Principal:
        return LEAD if request.headers.get("x-who") == "tara" else ADMIN_TOKEN


async def test_a_team_admin_manages_its_teams_keys_and_reads_its_usage(tmp_path: Path) -> None:
    async with opened_plane(tmp_path) as (cp, _):
        research = await cp.teams.create(TeamInfo(team_id="-", name="research", rpm=60))
        await cp.teams.create(TeamInfo(team_id="-", name="sales"))
        ours, _ = await cp.keys.create(name="r1", team_id="research")
        theirs, _ = await cp.keys.create(name="s1", team_id="sales")
        operators, _ = await cp.keys.create(name="ops")
        await cp.gateways.record_usage([
            UsageRecord(minute=int(time.time()) // 60 * 60, key_id=k.key_id, model="m",
                        requests=n) for k, n in ((ours, 2), (theirs, 5))])
        app = FastAPI()
        install_error_handlers(app, cp.leader_hint)
        app.include_router(build_admin_router(cp, door=HeaderDoor(cp.credentials.is_admin)),
                           prefix="/admin/v1")
        async with serve_asgi(app) as url, httpx.AsyncClient(
                base_url=url + "/admin/v1", headers={"x-who": "tara"}) as tara:
            keys = (await tara.get("/keys")).json()
            assert [k["key_id"] for k in keys] == [ours.key_id]
            assert [t["name"] for t in (await tara.get("/teams")).json()] == ["research"]
            assert (await tara.get("/teams/sales")).status_code == 403
            made = await tara.post("/keys", json={"name": "r2", "team": "research"})
            assert made.status_code == 201 and made.json()["key"]["team_id"] == research.team_id
            refused = await tara.post("/keys", json={"name": "mine"})
            assert refused.status_code == 403
            assert "the operator (no team)" in refused.json()["error"]["message"]
            assert (await tara.delete(f"/keys/{theirs.key_id}")).status_code == 403
            assert (await tara.delete(f"/keys/{operators.key_id}")).status_code == 403
            moved = await tara.patch(f"/keys/{ours.key_id}", json={"team": "sales"})
            assert moved.status_code == 403 and "team 'sales'" in moved.json()["error"]["message"]
            limits = await tara.patch(f"/keys/{ours.key_id}", json={"rpm": 10})
            assert limits.status_code == 200 and limits.json()["rpm"] == 10
            # Teams themselves (their limits and budgets) are the admins'.
            assert (await tara.patch("/teams/research", json={"rpm": 600})).status_code == 403
            usage = (await tara.get("/usage", params={"team": "research"})).json()
            assert usage["total"]["requests"] == 2
            assert (await tara.get("/usage")).status_code == 403
            assert (await tara.get("/usage/report", params={"team": "sales"})).status_code == 403
            report = (await tara.get("/usage/report", params={"team": "research",
                                                              "by": "key"})).json()
            assert [r["key_id"] for r in report["rows"]] == [ours.key_id]
            # The admin token still reaches everything.
            every = (await tara.get("/keys", headers={"x-who": "admin"})).json()
            assert len(every) >= 4
