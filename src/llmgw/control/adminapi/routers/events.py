"""``/events``: what the control plane did and why, oldest first."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import json_response
from llmgw.control.plane import ControlPlane


def events_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    @router.get("/events", response_model=list[schemas.EventView], tags=["events"])
    async def list_events(
        kind: str | None = None,
        subject: str | None = None,
        since: Annotated[int, Query(ge=0, le=2**62, description="after this event id")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    ) -> Response:
        """The latest events after ``since``, oldest first."""
        rows = await cp.store.list_events(since_id=since, kind=kind, subject=subject,
                                          limit=limit)
        return json_response([schemas.event_view(r) for r in reversed(rows)])

    return router
