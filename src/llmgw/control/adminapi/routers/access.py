"""``/whoami``: the caller as the admin API sees it (who, which roles, what it may do)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from llmgw.control.access.roles import Action
from llmgw.control.adminapi.adminroute import json_response, principal_of
from llmgw.control.plane import ControlPlane


class WhoAmI(BaseModel):
    subject: str
    name: str
    via: str
    roles: list[str]
    teams: list[str]
    actions: list[str]


def access_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    del cp  # the caller is all this router reads
    router = APIRouter(route_class=route_class)

    @router.get("/whoami", response_model=WhoAmI, tags=["access"])
    async def whoami(request: Request) -> Response:
        """Lets the console show only what the caller's roles allow, and scripts check a token."""
        principal = principal_of(request)
        return json_response(WhoAmI(
            subject=principal.subject, name=principal.name or principal.subject,
            via=principal.via, roles=sorted(principal.roles), teams=sorted(principal.teams),
            actions=[a.value for a in Action if principal.may(a)],
        ))

    return router
