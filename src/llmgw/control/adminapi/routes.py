"""The admin API (``/admin/v1``): fleet views, catalog, nodes, gateways, keys, teams, usage, events.

One router per resource (adminapi.routers), mounted here in one order: the
name convertor takes slashes, so where two paths could match one URL the
first mounted wins, and the schema lists operations in this order too.
Every route is an admin route (adminapi.adminroute: the caller and its role
checked first, errors answered in the APIs' one shape). On a standby control-plane
instance, writes are refused with 503 and the leader's URL
(llmgw.control.standby); reads are served.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Security
from fastapi.security import HTTPBearer

from llmgw.control.access.door import Door
from llmgw.control.adminapi.adminroute import admin_route_class
from llmgw.control.adminapi.patroni import PatroniReader, patroni_urls_from_env
from llmgw.control.adminapi.routers.access import access_router
from llmgw.control.adminapi.routers.credentials import credentials_router
from llmgw.control.adminapi.routers.events import events_router
from llmgw.control.adminapi.routers.fleet import fleet_router
from llmgw.control.adminapi.routers.gateways import gateways_router
from llmgw.control.adminapi.routers.keys import keys_router
from llmgw.control.adminapi.routers.models import models_router
from llmgw.control.adminapi.routers.nodes import nodes_router
from llmgw.control.adminapi.routers.replicas import replicas_router
from llmgw.control.adminapi.routers.teams import teams_router
from llmgw.control.adminapi.routers.usage import usage_router
from llmgw.control.plane import ControlPlane
from llmgw.wire import ErrorBody

_bearer = HTTPBearer(auto_error=False, description="The admin token (llmgw-admin-...), or an"
                     " identity provider's access token for this API (docs/sso.md).")


def build_admin_router(
    cp: ControlPlane, *, patroni_urls: Sequence[str] | None = None, door: Door | None = None
) -> APIRouter:
    """The admin API, to be mounted at ``/admin/v1``.

    ``patroni_urls`` default to ``LLMGW_PATRONI_URL`` (comma-separated); the
    summary lists the store's members from them.
    """
    patroni = PatroniReader(patroni_urls if patroni_urls is not None
                            else patroni_urls_from_env())
    route_class = admin_route_class(cp, door)
    router = APIRouter(
        route_class=route_class,
        dependencies=[Security(_bearer)],
        responses={
            401: {"model": ErrorBody, "description": "No credential, or a wrong one"},
            403: {"model": ErrorBody, "description": "The caller's role does not allow this"},
            422: {"model": ErrorBody, "description": "Invalid request"},
        },
    )
    router.include_router(fleet_router(cp, route_class, patroni))
    for resource in (nodes_router, replicas_router, models_router, gateways_router,
                     events_router, keys_router, teams_router, usage_router,
                     credentials_router, access_router):
        router.include_router(resource(cp, route_class))
    return router
