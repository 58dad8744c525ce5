"""The fleet's secrets: join tokens made, listed and revoked; the three tokens rotated."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_response
from llmgw.control.plane import ControlPlane


def credentials_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)
    credentials = cp.credentials

    @router.post("/join-token/rotate", response_model=schemas.JoinToken, tags=["credentials"])
    async def rotate_join_token() -> Response:
        """A new join token; the old one stops working (registered nodes keep theirs)."""
        return json_response(schemas.JoinToken(join_token=await credentials.rotate_join_token()))

    @router.post("/admin-token/rotate", response_model=schemas.RotatedToken,
                 tags=["credentials"])
    async def rotate_admin_token() -> Response:
        """A new admin token; this one stops working (a standby follows within seconds)."""
        return json_response(schemas.RotatedToken(token=await credentials.rotate_token("admin")))

    @router.post("/gateway-token/rotate", response_model=schemas.RotatedToken,
                 tags=["credentials"])
    async def rotate_gateway_token() -> Response:
        """A new gateway token; standalone gateways need it before their next sync."""
        token = await credentials.rotate_token("gateway")
        return json_response(schemas.RotatedToken(token=token))

    @router.get("/join-tokens", response_model=list[schemas.JoinTokenView],
                tags=["credentials"])
    async def list_join_tokens() -> Response:
        """Join tokens (never their secrets), newest first."""
        now = time.time()
        tokens = sorted(credentials.join_tokens.tokens.values(), key=lambda t: -t.created_at)
        return json_response([t.view(now) for t in tokens])

    @router.post("/join-tokens", response_model=schemas.JoinTokenCreated, status_code=201,
                 tags=["credentials"])
    async def create_join_token(body: schemas.JoinTokenCreate) -> Response:
        """A new join token (the others keep working); its secret is in this answer only."""
        ttl = credentials.join_token_ttl_s if body.ttl_s is None else (body.ttl_s or None)
        token, secret = await credentials.create_join_token(ttl_s=ttl, max_uses=body.uses,
                                                            description=body.description)
        return json_response({"token": token.view(time.time()), "join_token": secret},
                             status=201)

    @router.delete("/join-tokens/{token_id}", response_model=schemas.JoinTokenView,
                   responses=NOT_FOUND, tags=["credentials"])
    async def revoke_join_token(token_id: str) -> Response:
        """Stop a join token from working (nodes registered with it keep their own tokens)."""
        token = await credentials.revoke_join_token(token_id)
        return json_response(token.view(time.time()))

    return router
