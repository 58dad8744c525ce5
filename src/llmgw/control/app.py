"""The control plane's HTTP surface: agent API, gateway link API, admin API.

Each API takes exactly one kind of credential (llmgw.secrets): node tokens on
/agent, the gateway token on /gateway, the admin token on /admin. A node
token that works on the admin API, or an API key that works anywhere but
/v1, would turn one leaked secret into a leaked fleet.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw import secrets
from llmgw.console.server import mount_console
from llmgw.control.adminapi.routes import build_admin_router
from llmgw.control.service import ControlPlane
from llmgw.errors import AuthError, NotFoundError, StoreError, ValidationError
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


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"request body is not valid JSON: {exc}") from None


def create_app(cp: ControlPlane, *, title: str = "llmgw control plane") -> FastAPI:
    app = FastAPI(title=title, version="1", docs_url="/admin/docs",
                  openapi_url="/admin/v1/openapi.json")
    app.state.cp = cp

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

    # -- agent API ---------------------------------------------------------

    @app.post("/agent/v1/register", include_in_schema=False)
    async def register(request: Request) -> Response:
        reg = AgentRegistration.model_validate(await _body(request))
        return _json(await cp.register(reg))

    @app.post("/agent/v1/report", include_in_schema=False)
    async def report(request: Request) -> Response:
        node = cp.node_for_token(secrets.bearer(request.headers.get("authorization")))
        body = AgentReport.model_validate(await _body(request))
        if body.node != node.name:
            return error_body(403, f"this token speaks for node {node.name!r} only",
                              "permission_error", "wrong_node")
        return _json(await cp.report(node, body))

    # -- gateway link API ----------------------------------------------------

    def _gateway(request: Request) -> None:
        if not cp.is_gateway(secrets.bearer(request.headers.get("authorization"))):
            raise AuthError("a gateway token is required")

    @app.get("/gateway/v1/config", include_in_schema=False)
    async def gateway_config(request: Request, after: int = -1, wait: float = 25.0) -> Response:
        _gateway(request)
        config = await cp.watch_config(after, wait_s=max(0.0, min(wait, 60.0)))
        return _json(config)

    @app.post("/gateway/v1/load", include_in_schema=False, status_code=204)
    async def gateway_load(request: Request) -> Response:
        _gateway(request)
        await cp.record_load(GatewayLoadReport.model_validate(await _body(request)))
        return Response(status_code=204)

    @app.post("/gateway/v1/demand", include_in_schema=False, status_code=202)
    async def gateway_demand(request: Request) -> Response:
        _gateway(request)
        demand = DemandRequest.model_validate(await _body(request))
        await cp.demand(demand.model)
        return Response(status_code=202)

    @app.post("/gateway/v1/usage", include_in_schema=False, status_code=204)
    async def gateway_usage(request: Request) -> Response:
        _gateway(request)
        await cp.record_usage(_usage_list.validate_python(await _body(request)))
        return Response(status_code=204)

    app.include_router(build_admin_router(cp), prefix="/admin/v1")
    mount_console(app, cp)
    return app
