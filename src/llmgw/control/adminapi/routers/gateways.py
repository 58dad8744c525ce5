"""``/gateways``: which gateways follow this control plane, and how they place new prefixes."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import json_response
from llmgw.control.plane import ControlPlane


def gateways_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    @router.get("/gateways", response_model=schemas.GatewaysAnswer, tags=["gateways"])
    async def list_gateways() -> Response:
        """The gateways reporting their load, and the count the routing table tells them.

        Served by a standby too, like every read: it hears no reports (they
        go to the leader), so it says ``leader: false`` and lists none.
        """
        now = time.monotonic()
        count, reports = cp.gateways.reporting(now)
        return json_response(schemas.gateways_answer(count, cp.is_leader, reports, now))

    return router
