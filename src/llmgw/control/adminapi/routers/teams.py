"""``/teams``: tenants made, listed, changed and deleted (their keys under ``/keys?team=``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.access.roles import Action
from llmgw.control.adminapi import teamscope
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_response
from llmgw.control.adminapi.tenancy_schemas import TeamCreate, TeamUpdate, TeamView, team_view
from llmgw.control.plane import ControlPlane
from llmgw.wire import TeamInfo


def teams_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    def view(team: TeamInfo) -> TeamView:
        return team_view(team, cp.keys.live_in_team(team.team_id))

    @router.post("/teams", response_model=TeamView, status_code=201, tags=["teams"])
    async def create_team(body: TeamCreate) -> Response:
        team = await cp.teams.create(TeamInfo(team_id="-", **body.model_dump()))
        return json_response(view(team), status=201)

    @router.get("/teams", response_model=list[TeamView], tags=["teams"])
    async def list_teams(request: Request) -> Response:
        """Every team; a team admin sees its own."""
        allowed = teamscope.scope(request, Action.TEAMS_READ)
        return json_response([view(t) for t in cp.teams.all()
                              if teamscope.in_scope(cp, allowed, t.team_id)])

    @router.get("/teams/{team}", response_model=TeamView, responses=NOT_FOUND, tags=["teams"])
    async def get_team(team: str, request: Request) -> Response:
        """One team, by id or name."""
        found = cp.teams.get(team)
        teamscope.require(request, cp, Action.TEAMS_READ, found.team_id, f"GET /teams/{team}")
        return json_response(view(found))

    @router.patch("/teams/{team}", response_model=TeamView, responses=NOT_FOUND, tags=["teams"])
    async def update_team(team: str, body: TeamUpdate) -> Response:
        """Change the fields sent; null clears a limit."""
        return json_response(view(await cp.teams.update(team, body.model_dump(exclude_unset=True))))

    @router.delete("/teams/{team}", response_model=TeamView, responses=NOT_FOUND, tags=["teams"])
    async def delete_team(team: str) -> Response:
        """Delete a team; refused (422) while live keys belong to it."""
        found = cp.teams.get(team)
        return json_response(view(await cp.teams.delete(found.team_id,
                                                        cp.keys.live_in_team(found.team_id))))

    return router
