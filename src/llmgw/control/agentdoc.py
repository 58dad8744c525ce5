"""The agent API (``/agent/v1``) as an OpenAPI document, served at ``/agent/v1/openapi.json``.

Agents and the control plane speak llmgw's own wire (llmgw.wire), and the
routes are answered outside FastAPI's routing (the report by
control.reportroute, for its cost), so they are not in the admin API's
document. This one is generated from the same wire models the routes
validate with, so it cannot describe other shapes than they accept and
answer; tests/control/test_agent_openapi.py holds its operations to the
routes the control plane serves, and schemathesis fuzzes the routes from it.
Like the admin API's document it is public: it says nothing about a fleet.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, FastAPI, Security
from fastapi.security import HTTPBearer

from llmgw.wire import (
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
    ErrorBody,
)

OPENAPI_PATH = "/agent/v1/openapi.json"

_join = HTTPBearer(scheme_name="joinToken", auto_error=False,
                   description="A join token (llmgw-join-...), checked before the body is read.")
_node = HTTPBearer(scheme_name="nodeToken", auto_error=False,
                   description="The node token the registration answered with (llmgw-node-...).")

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No token, or one that is unknown, revoked or"
          " expired"},
    403: {"model": ErrorBody, "description": "A node token of another node"},
    408: {"model": ErrorBody, "description": "The body did not arrive in time"},
    413: {"model": ErrorBody, "description": "The body is over the route's limit"},
    422: {"model": ErrorBody, "description": "A body that is not the wire's shape"},
    503: {"model": ErrorBody, "description": "A standby: the leader's URL is in X-Llmgw-Leader"},
}


def _document() -> dict[str, Any]:
    app = FastAPI(title="llmgw agent API", version="1", openapi_url=None, docs_url=None,
                  redoc_url=None)
    router = APIRouter(responses=_ERRORS)

    @router.post("/agent/v1/register", response_model=AgentRegistrationAnswer,
                 dependencies=[Security(_join)], summary="Register a node for its node token")
    async def register(body: AgentRegistration) -> AgentRegistrationAnswer:
        """A join token buys a node token, once per node name (again only with the same
        agent key). The join token goes in the Authorization header; ``join_token`` in
        the body may only repeat it."""
        raise NotImplementedError  # a document only: control/app.py answers

    @router.post("/agent/v1/report", response_model=AgentReportAnswer,
                 dependencies=[Security(_node)], summary="Report a node, get its assignments")
    async def report(body: AgentReport) -> AgentReportAnswer:
        """The node's inventory and replicas, answered with every replica it should run."""
        raise NotImplementedError  # a document only: control/reportroute.py answers

    app.include_router(router)
    return app.openapi()


@functools.cache
def agent_openapi() -> dict[str, Any]:
    """The document (built once: it depends on the wire models alone)."""
    return _document()
