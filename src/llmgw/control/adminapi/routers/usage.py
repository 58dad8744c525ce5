"""``/usage``: per-minute rows for dashboards, and ``/usage/report``: sums over any period
(llmgw.control.adminapi.usagereport) as JSON or a CSV download."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.access.roles import Action
from llmgw.control.adminapi import schemas, teamscope
from llmgw.control.adminapi.adminroute import json_response
from llmgw.control.adminapi.usagereport import (
    DEFAULT_WINDOW_S,
    MAX_TIME,
    UsageReport,
    build_report,
    csv_filename,
    parse_by,
    to_csv,
)
from llmgw.control.plane import ControlPlane
from llmgw.errors import ValidationError

# Usage without a ``since`` covers the last hour: an unbounded default would
# make the first innocent call on a busy gateway read months of rows.
DEFAULT_USAGE_WINDOW_S = 3600


def usage_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)

    def _team(request: Request, team: str | None, what: str) -> str | None:
        """The team asked for; a team admin must ask for one of its own."""
        team_id = cp.teams.get(team).team_id if team else None
        teamscope.require(request, cp, Action.USAGE_READ, team_id, what)
        return team_id

    @router.get("/usage", response_model=schemas.UsageAnswer, tags=["usage"])
    async def usage(
        request: Request,
        since: Annotated[int | None, Query(ge=0, le=2**40,
                                           description="unix time; default: an hour ago")] = None,
        key_id: str | None = None,
        model: str | None = None,
        team: str | None = None,
    ) -> Response:
        """Requests and tokens per minute, key and model, with totals (``team``: its keys')."""
        start = since if since is not None else int(time.time()) - DEFAULT_USAGE_WINDOW_S
        team_id = _team(request, team, "GET /usage")
        rows = await cp.store.query_usage(since=start // 60 * 60, key_id=key_id, model=model,
                                          team_id=team_id)
        return json_response(schemas.usage_answer(start, rows))

    @router.get("/usage/report", response_model=UsageReport, tags=["usage"],
                responses={200: {"content": {"text/csv": {}}}})
    async def usage_report(
        request: Request,
        since: Annotated[int | None, Query(ge=0, le=MAX_TIME,
                                           description="unix time; default: 30 days ago")] = None,
        until: Annotated[int | None, Query(
            ge=0, le=MAX_TIME, description="unix time, exclusive; default: now")] = None,
        by: Annotated[str, Query(max_length=40,
                                 description="team, key, model, day (UTC), or several:"
                                             " day,model")
                      ] = "key,model",
        key_id: Annotated[str | None, Query(max_length=32)] = None,
        model: Annotated[str | None, Query(max_length=200)] = None,
        team: Annotated[str | None, Query(max_length=200)] = None,
        format: Annotated[Literal["json", "csv"], Query()] = "json",
    ) -> Response:
        """Requests, tokens and spend summed per team, key, model and/or UTC day over
        [since, until); ``team`` (id or name) keeps that team's usage only."""
        dimensions = parse_by(by)
        end = until if until is not None else int(time.time())
        start = (since if since is not None else end - DEFAULT_WINDOW_S) // 60 * 60
        if end <= start:
            raise ValidationError("until must be after since", field="until")
        team_id = _team(request, team, "GET /usage/report")
        rows = await cp.store.usage_report(since=start, until=end, by=dimensions,
                                           key_id=key_id, model=model, team_id=team_id)
        names = {k.key_id: k.name for k in cp.keys.all()}
        teams = {t.team_id: t.name for t in cp.teams.all()}
        report = build_report(start, end, dimensions, rows, names, teams)
        if format == "csv":
            return Response(to_csv(report), media_type="text/csv; charset=utf-8", headers={
                "Content-Disposition": f'attachment; filename="{csv_filename(report)}"'})
        return Response(report.model_dump_json(), media_type="application/json")

    return router
