"""``/summary``: the whole fleet in one answer."""

from __future__ import annotations

import time

import orjson
from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adapters import plan_adapters
from llmgw.control.adminapi.patroni import PatroniReader
from llmgw.control.adminapi.summary import Summary
from llmgw.control.adminapi.summary_keeper import SummaryKeeper
from llmgw.control.gcpause import paused_gc
from llmgw.control.plane import ControlPlane


def fleet_router(
    cp: ControlPlane, route_class: type[APIRoute], patroni: PatroniReader
) -> APIRouter:
    router = APIRouter(route_class=route_class)
    state = cp.state
    # fleet_summary's answer, kept between calls (summary_keeper.py).
    kept_summary = SummaryKeeper().summary_json

    @router.get("/summary", response_model=Summary, tags=["fleet"])
    async def get_summary() -> Response:
        """The whole fleet in one answer."""
        store = await patroni.status()
        now = time.time()
        with paused_gc():  # see paused_gc: the bytes are made before the views are freed
            body = kept_summary(state, now, store)
        bases = plan_adapters(state, now).bases
        if bases:
            # What the last pass decided, from the same facts (a pure
            # function): only fleets with adapters pay for the second dump.
            answer = orjson.loads(body)
            answer["adapters"] = [b.model_dump(mode="json") for b in bases.values()]
            body = orjson.dumps(answer)
        return Response(body, media_type="application/json")

    return router
