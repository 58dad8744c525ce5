"""``/keys``: API keys made (the secret shown once), listed, changed and revoked."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_response
from llmgw.control.plane import ControlPlane
from llmgw.errors import NotFoundError
from llmgw.wire import TenantLimits


def keys_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    @router.post("/keys", response_model=schemas.KeyCreated, status_code=201, tags=["keys"],
                 responses=NOT_FOUND)
    async def create_key(body: schemas.KeyCreate) -> Response:
        """A new API key; its secret is in this answer and nowhere else, ever."""
        limits = TenantLimits.model_validate(
            body.model_dump(include=set(TenantLimits.model_fields)))
        info, secret = await cp.keys.create(
            name=body.name, models=body.models, expires_at=body.expires_at,
            team_id=body.team, limits=limits,
        )
        return json_response(schemas.KeyCreated(key=schemas.key_view(info), secret=secret),
                             status=201)

    @router.get("/keys", response_model=list[schemas.KeyView], tags=["keys"])
    async def list_keys(team: str | None = None) -> Response:
        """Every key, or a team's (``team``: its id or name)."""
        keys = cp.keys.all()
        if team:
            team_id = cp.teams.get(team).team_id
            keys = [k for k in keys if k.team_id == team_id]
        return json_response([schemas.key_view(k) for k in keys])

    @router.patch("/keys/{key_id}", response_model=schemas.KeyView, responses=NOT_FOUND,
                  tags=["keys"])
    async def update_key(key_id: str, body: schemas.KeyUpdate) -> Response:
        """Move a key to a team (``team``: null, the operator's) or change its models or limits."""
        changes = body.model_dump(exclude_unset=True)
        if "team" in changes:
            changes["team_id"] = changes.pop("team")
        return json_response(schemas.key_view(await cp.keys.update(key_id, changes)))

    @router.delete("/keys/{key_id}", response_model=schemas.KeyView, responses=NOT_FOUND,
                   tags=["keys"])
    async def revoke_key(key_id: str) -> Response:
        await cp.keys.revoke(key_id)
        info = next((k for k in cp.keys.all() if k.key_id == key_id), None)
        if info is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return json_response(schemas.key_view(info))

    return router
