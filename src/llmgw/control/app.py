"""The control plane's HTTP surface: agent API, gateway link API, admin API.

Each API takes exactly one kind of credential (llmgw.secrets): node tokens on
/agent, the gateway token on /gateway, the admin token on /admin (or, with
single sign-on, a person's session or provider token, held to their role:
llmgw.control.access). A node
token that works on the admin API, or an API key that works anywhere but
/v1, would turn one leaked secret into a leaked fleet.

On a standby (llmgw.control.standby) the agent API and the gateway link
answer 503 with the leader's URL, and so do admin writes; admin reads are
served from the standby's refreshed views.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import generate_latest
from pydantic import TypeAdapter
from starlette.routing import Route

from llmgw import secrets
from llmgw.console.server import mount_console
from llmgw.control.access.door import Door
from llmgw.control.access.login import login_routes
from llmgw.control.access.settings import OidcSettings
from llmgw.control.adminapi.routes import build_admin_router
from llmgw.control.agentdoc import OPENAPI_PATH as AGENT_OPENAPI_PATH
from llmgw.control.agentdoc import agent_openapi
from llmgw.control.httperrors import error_response, install_error_handlers
from llmgw.control.limits import BodyLimit
from llmgw.control.metrics import control_registry
from llmgw.control.plane import ControlPlane
from llmgw.control.reportroute import REPORT_PATH, CountReports, ReportEndpoint, ReportRoute
from llmgw.errors import AuthError, ValidationError
from llmgw.http.contract import Endpoint
from llmgw.promkit import CONTENT_TYPE, scrape_allowed
from llmgw.wire import (
    AgentRegistration,
    AllowanceReport,
    DemandRequest,
    GatewayLoadReport,
    UsageRecord,
)

_usage_list = TypeAdapter(list[UsageRecord])


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


class ControlApp(FastAPI):
    """The control plane's app, and the routes it answers without its middleware stack.

    An app for llmgw's server (llmgw.http.contract.App): ``endpoints`` run there
    without FastAPI's own layers.
    """

    endpoints: dict[tuple[str, str], Endpoint]


def create_app(
    cp: ControlPlane, *, title: str = "llmgw control plane", metrics_token: str | None = None,
    sso: OidcSettings | None = None,
) -> ControlApp:
    # No /admin/docs or /redoc: FastAPI's pages load their scripts from a CDN
    # into the console's origin, where the admin token lives, and answered
    # without any token. The schema itself stays at /admin/v1/openapi.json.
    app = ControlApp(title=title, version="1", docs_url=None, redoc_url=None,
                     openapi_url="/admin/v1/openapi.json")
    app.state.cp = cp
    _agent_reports(app, cp)
    install_error_handlers(app, cp.leader_hint)
    _health_and_metrics(app, cp, metrics_token)
    _agent_api(app, cp)
    _gateway_link(app, cp)
    # Who calls the admin API (the admin token; with SSO also console sessions
    # and provider tokens): one door for every admin route and the console's sign-in.
    door = Door(cp.credentials.is_admin, sso)
    app.state.door = door
    app.include_router(build_admin_router(cp, door=door), prefix="/admin/v1")
    app.router.routes.extend(login_routes(door))
    mount_console(app, cp)
    return app


def _agent_reports(app: ControlApp, cp: ControlPlane) -> None:
    """Agent reports: one endpoint (reportroute.py), reached three ways."""
    reports = ReportEndpoint(cp, app.exception_handlers)
    # Innermost: reports answered without the routing below.
    app.add_middleware(ReportRoute, endpoint=reports)
    app.add_middleware(BodyLimit)
    app.add_middleware(CountReports, metrics=cp.metrics)  # outermost: sees BodyLimit's 413s
    # The same endpoint in the same two layers, without the framework's own
    # (its app, error and body-limit middlewares, each a frame and a send
    # wrapper a report), for servers that run endpoints by (method, path)
    # (llmgw.http.connection, through serve's PathDispatcher).
    app.endpoints = {
        ("POST", REPORT_PATH): CountReports(BodyLimit(reports), metrics=cp.metrics),
    }
    # And in the route table, where other methods meet the framework's 405.
    app.router.routes.append(
        Route(REPORT_PATH, reports, methods=["POST"], include_in_schema=False)
    )


def _health_and_metrics(app: ControlApp, cp: ControlPlane, metrics_token: str | None) -> None:
    """Health checks, open to all, and /metrics behind its optional token."""
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
            return error_response(401, "/metrics needs the metrics token"
                                  " (Authorization: Bearer ...).",
                                  "authentication_error", "invalid_token")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)


def _agent_api(app: ControlApp, cp: ControlPlane) -> None:
    """The agent API besides reports: its document, and registration with the join token."""

    @app.get(AGENT_OPENAPI_PATH, include_in_schema=False)
    async def agent_api_document() -> Response:
        return _json_dict(agent_openapi())

    # The standby check comes before the credentials: a standby's view of the
    # nodes is up to seconds old, and refusing a just-registered node's token
    # would make its agent throw the token away and try to register again.

    @app.post("/agent/v1/register", include_in_schema=False)
    async def register(request: Request) -> Response:
        # The join token is in the head and checked before a byte of the body
        # is read: an unauthenticated caller holds no route waiting for a
        # body, nor the memory of one (docs/security.md, Limits).
        join_token = secrets.bearer(request.headers.get("authorization"))
        cp.nodes.admit(join_token)
        reg = AgentRegistration.model_validate(await _body(request))
        if reg.join_token is not None and reg.join_token != join_token:
            raise ValidationError("the body's join_token is not the Authorization header's:"
                                  " send the join token in the header only", field="join_token")
        return _json(await cp.nodes.register(reg, join_token))


def _gateway_link(app: ControlApp, cp: ControlPlane) -> None:
    """The gateway link API (config watch, load, demand, usage), with the gateway token."""
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

    @app.post("/gateway/v1/allowance", include_in_schema=False)
    async def gateway_allowance(request: Request) -> Response:
        # The leader's alone (_gateway refuses a standby): shares are lent
        # out of one book, in its memory (llmgw.allowance).
        _gateway(request)
        report = AllowanceReport.model_validate(await _body(request))
        return _json(await cp.allowances.exchange(report))

    @app.post("/gateway/v1/usage", include_in_schema=False, status_code=204)
    async def gateway_usage(request: Request) -> Response:
        # Usage counters are additive, so any instance could write them (the
        # in-process gateway of a standby does); the refusal in _gateway keeps
        # a standalone gateway's calls together on the leader, where its
        # demand and load must go anyway.
        _gateway(request)
        await cp.gateways.record_usage(_usage_list.validate_python(await _body(request)))
        return Response(status_code=204)
