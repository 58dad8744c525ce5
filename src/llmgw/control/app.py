"""The control plane's HTTP surface: agent API, gateway link API, admin API.

Each API takes exactly one kind of credential (llmgw.secrets): node tokens on
/agent, the gateway token on /gateway, the admin token on /admin. A node
token that works on the admin API, or an API key that works anywhere but
/v1, would turn one leaked secret into a leaked fleet.

On a standby (llmgw.control.standby) the agent API and the gateway link
answer 503 with the leader's URL, and so do admin writes; admin reads are
served from the standby's refreshed views.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw import secrets
from llmgw.console.server import mount_console
from llmgw.control.adminapi.routes import build_admin_router
from llmgw.control.limits import BodyLimit
from llmgw.control.metrics import CountReports, control_registry
from llmgw.control.reportroute import ReportRoute
from llmgw.control.service import ControlPlane
from llmgw.control.standby import standby_response
from llmgw.errors import (
    AuthError,
    NotFoundError,
    NotLeaderError,
    StandbyError,
    StoreError,
    ValidationError,
)
from llmgw.promkit import CONTENT_TYPE, scrape_allowed
from llmgw.wire import (
    AgentRegistration,
    AgentReport,
    DemandRequest,
    GatewayLoadReport,
    UsageRecord,
)

log = logging.getLogger(__name__)

_usage_list = TypeAdapter(list[UsageRecord])


def error_body(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": code}}, status_code=status
    )


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _json_dict(value: dict[str, Any]) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"request body is not valid JSON: {exc}") from None


def create_app(
    cp: ControlPlane, *, title: str = "llmgw control plane", metrics_token: str | None = None
) -> FastAPI:
    # No /admin/docs or /redoc: FastAPI's pages load their scripts from a CDN
    # into the console's origin, where the admin token lives, and answered
    # without any token. The schema itself stays at /admin/v1/openapi.json.
    app = FastAPI(title=title, version="1", docs_url=None, redoc_url=None,
                  openapi_url="/admin/v1/openapi.json")
    app.state.cp = cp
    # Innermost: agent reports answered without the routing below (reportroute.py).
    app.add_middleware(ReportRoute, cp=cp, handlers=app.exception_handlers)
    app.add_middleware(BodyLimit)
    app.add_middleware(CountReports, metrics=cp.metrics)  # outermost: sees BodyLimit's 413s

    @app.exception_handler(AuthError)
    async def _auth(_: Request, exc: AuthError) -> JSONResponse:
        return error_body(401, str(exc), "authentication_error", "invalid_token")

    @app.exception_handler(ValidationError)
    async def _invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return error_body(422, str(exc), "invalid_request_error", exc.field)

    @app.exception_handler(PydanticValidationError)
    async def _invalid_wire(_: Request, exc: PydanticValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return error_body(422, problems, "invalid_request_error")

    @app.exception_handler(StandbyError)
    async def _standby(_: Request, exc: StandbyError) -> Response:
        return await standby_response(cp.leader_hint, exc)

    @app.exception_handler(NotLeaderError)
    async def _deposed(_: Request, exc: NotLeaderError) -> Response:
        # The write was refused for a stale epoch and this instance stepped
        # down (llmgw.control.writes): the caller is sent on like a standby's.
        return await standby_response(
            cp.leader_hint, StandbyError(f"this instance no longer leads: {exc}"))

    @app.exception_handler(NotFoundError)
    async def _missing(_: Request, exc: NotFoundError) -> JSONResponse:
        return error_body(404, str(exc), "not_found_error", "not_found")

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        log.error("store error: %s", exc)
        return JSONResponse(
            {"error": {"message": str(exc), "type": "store_error", "code": None}},
            status_code=503,
            headers={"Retry-After": "2"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and wrong methods answer in the same shape as every
        # other error, not FastAPI's {"detail": ...}.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            {"error": {"message": str(exc.detail), "type": kind, "code": None}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        return {"status": "ok", "leader": cp.is_leader, "epoch": cp.epoch}

    @app.get("/healthz/leader", include_in_schema=False)
    async def healthz_leader() -> Response:
        """200 on the leader, 503 on a standby: a load balancer's health check."""
        cp.require_leader()
        return _json_dict({"status": "ok", "leader": True, "epoch": cp.epoch})

    registry = control_registry(cp)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        """The control plane's families alone (docs/metrics.md).

        ``llmgw up`` and ``serve`` send /metrics to their gateway instead,
        which carries these families beside its own: one scrape target per
        process. The same optional token guards both.
        """
        if not scrape_allowed(request.headers.get("authorization"), metrics_token):
            return error_body(401, "/metrics needs the metrics token (Authorization: Bearer ...).",
                              "authentication_error", "invalid_token")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    # -- agent API ---------------------------------------------------------
    # The standby check comes before the credentials: a standby's view of the
    # nodes is up to seconds old, and refusing a just-registered node's token
    # would make its agent throw the token away and try to register again.

    @app.post("/agent/v1/register", include_in_schema=False)
    async def register(request: Request) -> Response:
        cp.require_leader()
        reg = AgentRegistration.model_validate(await _body(request))
        return _json(await cp.nodes.register(reg))

    # Answered by the ReportRoute middleware (reportroute.py) before routing;
    # declared here too, for other methods' 405 and for an app built without it.
    @app.post("/agent/v1/report", include_in_schema=False)
    async def report(request: Request) -> Response:
        cp.require_leader()
        node = cp.nodes.for_token(secrets.bearer(request.headers.get("authorization")))
        body = AgentReport.model_validate(await _body(request))
        if body.node != node.name:
            return error_body(403, f"this token speaks for node {node.name!r} only",
                              "permission_error", "wrong_node")
        return _json(await cp.agents.report(node, body))

    # -- gateway link API ----------------------------------------------------
    # All of it, the config watch included, is the leader's: a gateway that
    # watched a standby would route from views refreshed only every few
    # seconds (a new replica, or a lost node, reaches it late), and routing
    # versions are one instance's counter, so following two instances at once
    # would compare numbers that mean nothing to each other. The gateway keeps
    # its last config while it moves.

    def _gateway(request: Request) -> None:
        cp.require_leader()
        if not cp.credentials.is_gateway(secrets.bearer(request.headers.get("authorization"))):
            raise AuthError("a gateway token is required")

    @app.get("/gateway/v1/config", include_in_schema=False)
    async def gateway_config(request: Request, after: int = -1, wait: float = 25.0) -> Response:
        _gateway(request)
        config = await cp.gateways.watch(after, wait_s=max(0.0, min(wait, 60.0)))
        cp.require_leader()  # it may have stepped down during the wait
        return _json(config)

    @app.post("/gateway/v1/load", include_in_schema=False, status_code=204)
    async def gateway_load(request: Request) -> Response:
        _gateway(request)
        await cp.gateways.record_load(GatewayLoadReport.model_validate(await _body(request)))
        return Response(status_code=204)

    @app.post("/gateway/v1/demand", include_in_schema=False, status_code=202)
    async def gateway_demand(request: Request) -> Response:
        _gateway(request)
        demand = DemandRequest.model_validate(await _body(request))
        await cp.catalog.demand(demand.model)
        return Response(status_code=202)

    @app.post("/gateway/v1/usage", include_in_schema=False, status_code=204)
    async def gateway_usage(request: Request) -> Response:
        # Usage counters are additive, so any instance could write them (the
        # in-process gateway of a standby does); the refusal in _gateway keeps
        # a standalone gateway's calls together on the leader, where its
        # demand and load must go anyway.
        _gateway(request)
        await cp.gateways.record_usage(_usage_list.validate_python(await _body(request)))
        return Response(status_code=204)

    app.include_router(build_admin_router(cp), prefix="/admin/v1")
    mount_console(app, cp)
    return app
