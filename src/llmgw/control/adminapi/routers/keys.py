"""``/keys``: API keys made (the secret shown once), listed, changed and revoked."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.access.roles import Action
from llmgw.control.adminapi import schemas, teamscope
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_response
from llmgw.control.plane import ControlPlane
from llmgw.errors import NotFoundError
from llmgw.wire import TenantLimits


def keys_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    @router.post("/keys", response_model=schemas.KeyCreated, status_code=201, tags=["keys"],
                 responses=NOT_FOUND)
    async def create_key(body: schemas.KeyCreate, request: Request) -> Response:
        """A new API key; its secret is in this answer and nowhere else, ever."""
        team_id = cp.teams.get(body.team).team_id if body.team else None
        teamscope.require(request, cp, Action.KEYS_WRITE, team_id, "POST /keys")
        limits = TenantLimits.model_validate(
            body.model_dump(include=set(TenantLimits.model_fields)))
        info, secret = await cp.keys.create(
            name=body.name, models=body.models, expires_at=body.expires_at,
            team_id=body.team, limits=limits,
        )
        return json_response(schemas.KeyCreated(key=schemas.key_view(info), secret=secret),
                             status=201)

    @router.get("/keys", response_model=list[schemas.KeyView], tags=["keys"])
    async def list_keys(request: Request, team: str | None = None) -> Response:
        """Every key, or a team's (``team``: its id or name); a team admin sees its teams'."""
        keys = cp.keys.all()
        if team:
            team_id = cp.teams.get(team).team_id
            keys = [k for k in keys if k.team_id == team_id]
        allowed = teamscope.scope(request, Action.KEYS_READ)
        keys = [k for k in keys if teamscope.in_scope(cp, allowed, k.team_id)]
        return json_response([schemas.key_view(k) for k in keys])

    @router.patch("/keys/{key_id}", response_model=schemas.KeyView, responses=NOT_FOUND,
                  tags=["keys"])
    async def update_key(key_id: str, body: schemas.KeyUpdate, request: Request) -> Response:
        """Move a key to a team (``team``: null, the operator's) or change its models or limits."""
        what = f"PATCH /keys/{key_id}"
        teamscope.require(request, cp, Action.KEYS_WRITE, cp.keys.get(key_id).team_id, what)
        changes = body.model_dump(exclude_unset=True)
        if "team" in changes:
            target = changes.pop("team")
            changes["team_id"] = cp.teams.get(target).team_id if target else None
            teamscope.require(request, cp, Action.KEYS_WRITE, changes["team_id"], what)
        return json_response(schemas.key_view(await cp.keys.update(key_id, changes)))

    @router.delete("/keys/{key_id}", response_model=schemas.KeyView, responses=NOT_FOUND,
                   tags=["keys"])
    async def revoke_key(key_id: str, request: Request) -> Response:
        teamscope.require(request, cp, Action.KEYS_WRITE, cp.keys.get(key_id).team_id,
                          f"DELETE /keys/{key_id}")
        await cp.keys.revoke(key_id)
        info = next((k for k in cp.keys.all() if k.key_id == key_id), None)
        if info is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return json_response(schemas.key_view(info))

    return router
