"""Every admin operation fuzzed from its OpenAPI schema: no 5xx, answers match the schema.

A real control plane on loopback (SQLite store, a small fleet), the admin
token on every call, a bounded number of examples per operation so the file
stays fast on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.generation.case import Case
from schemathesis.schemas import BaseSchema
from tests.control.adminapi.fleetkit import Served, served_control_plane
from tests.control.adminapi.test_routes import live_fleet

from llmgw.control.adminapi.routes import build_admin_router
from llmgw.control.plane import ControlPlane
from llmgw.control.store.repo import Store


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served_control_plane(tmp_path_factory.mktemp("schemathesis"),
                              live_fleet().state) as served:
        yield served


def admin_schema() -> BaseSchema:
    """The router's schema as the app serves it, built without a server: it does not
    depend on the fleet (schemathesis' lazy fixture loader predates pytest 9)."""
    app = FastAPI()
    app.include_router(build_admin_router(ControlPlane(cast(Store, None)), patroni_urls=[]),
                       prefix="/admin/v1")
    return schemathesis.openapi.from_dict(app.openapi())


# Rotating the admin token mid-run would leave every later operation refused
# (the plane's token would be gone), and the gateway token rotation is its
# twin: both are tested in tests/cli/test_ctl_rotate.py.
schema = admin_schema().exclude(path_regex=r"^/admin/v1/(admin|gateway)-token/rotate$")


@schema.parametrize()
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_admin_api_never_fails_on_generated_requests(case: Case[Any], plane: Served) -> None:
    case.call_and_validate(
        base_url=plane.url,
        headers={"Authorization": f"Bearer {plane.admin_token}"},
        checks=[checks.not_a_server_error, checks.response_schema_conformance,
                checks.content_type_conformance],
    )
