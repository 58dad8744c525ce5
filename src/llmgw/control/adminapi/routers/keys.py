"""``/keys``: API keys made (the secret shown once), listed and revoked."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_response
from llmgw.control.plane import ControlPlane
from llmgw.errors import NotFoundError


def keys_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    @router.post("/keys", response_model=schemas.KeyCreated, status_code=201, tags=["keys"])
    async def create_key(body: schemas.KeyCreate) -> Response:
        """A new API key; its secret is in this answer and nowhere else, ever."""
        info, secret = await cp.keys.create(
            name=body.name, models=body.models, expires_at=body.expires_at,
            rpm=body.rpm, tpm=body.tpm,
        )
        return json_response(schemas.KeyCreated(key=schemas.key_view(info), secret=secret),
                             status=201)

    @router.get("/keys", response_model=list[schemas.KeyView], tags=["keys"])
    async def list_keys() -> Response:
        return json_response([schemas.key_view(k) for k in cp.keys.all()])

    @router.delete("/keys/{key_id}", response_model=schemas.KeyView, responses=NOT_FOUND,
                   tags=["keys"])
    async def revoke_key(key_id: str) -> Response:
        await cp.keys.revoke(key_id)
        info = next((k for k in cp.keys.all() if k.key_id == key_id), None)
        if info is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return json_response(schemas.key_view(info))

    return router
