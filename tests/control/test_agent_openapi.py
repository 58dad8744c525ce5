"""The agent API's OpenAPI document: true to the routes the control plane serves, and every
operation fuzzed from it (schemathesis) with its own credential: no 5xx, answers as documented.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.generation.case import Case
from starlette.routing import Route
from tests.control.adminapi.fleetkit import Served, served_control_plane
from tests.control.adminapi.test_routes import live_fleet
from tests.control.planekit import inventory

from llmgw.control.agentdoc import OPENAPI_PATH, agent_openapi
from llmgw.control.app import create_app

NODE = "node-fuzz"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served_control_plane(tmp_path_factory.mktemp("agentapi"), live_fleet().state) as served:
        yield served


@pytest.fixture(scope="module")
def node_token(plane: Served) -> str:
    return plane.node_token(NODE)


schema = schemathesis.openapi.from_dict(agent_openapi())


def test_the_document_has_every_agent_route_and_is_served(plane: Served) -> None:
    served = {(method, route.path) for route in create_app(plane.cp).routes
              if isinstance(route, Route) and route.path.startswith("/agent/v1/")
              and route.path != OPENAPI_PATH for method in route.methods or ()}
    documented = {(method.upper(), path) for path, item in agent_openapi()["paths"].items()
                  for method in item}
    assert documented == served == {("POST", "/agent/v1/register"), ("POST", "/agent/v1/report")}
    answer = httpx.get(plane.url + OPENAPI_PATH, timeout=10)  # public, as the admin API's
    assert answer.status_code == 200 and answer.json() == agent_openapi()


def credentials(case: Case[Any], plane: Served, node_token: str) -> dict[str, str]:
    """Each route's own credential; a report speaks for the token's node."""
    if case.path.endswith("/register"):
        return {"Authorization": f"Bearer {plane.join_token}"}
    if isinstance(case.body, dict):
        case.body["node"] = NODE
    return {"Authorization": f"Bearer {node_token}"}


@schema.parametrize()
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_agent_api_never_fails_on_generated_requests(
    case: Case[Any], plane: Served, node_token: str
) -> None:
    case.call_and_validate(
        base_url=plane.url, headers=credentials(case, plane, node_token),
        checks=[checks.not_a_server_error, checks.response_schema_conformance,
                checks.content_type_conformance],
    )


PAST_THE_STORE = [("memory_used_mib", 2**64), ("temperature_c", -(2**70)), ("number", 2**40)]


@pytest.mark.parametrize(("field", "value"), PAST_THE_STORE)
def test_a_report_with_an_integer_past_the_stores_is_refused_not_a_failed_write(
    plane: Served, node_token: str, field: str, value: int,
) -> None:
    device = inventory(NODE).devices[0].model_dump(mode="json") | {field: value}
    report = {"node": NODE, "inventory": {"hostname": NODE, "devices": [device]}}
    answer = httpx.post(plane.url + "/agent/v1/report", json=report, timeout=10,
                        headers={"Authorization": f"Bearer {node_token}"})
    assert answer.status_code == 422, answer.text  # was a 503: the store's write failed
    assert field in answer.json()["error"]["message"]


def test_a_report_with_two_devices_of_one_number_is_refused_not_a_failed_write(
    plane: Served, node_token: str,
) -> None:
    device = inventory(NODE).devices[0].model_dump(mode="json")
    report = {"node": NODE, "inventory": {"hostname": NODE, "devices": [device, device]}}
    answer = httpx.post(plane.url + "/agent/v1/report", json=report, timeout=10,
                        headers={"Authorization": f"Bearer {node_token}"})
    assert answer.status_code == 422, answer.text  # was a 503: the store's unique rows
    assert "unique" in answer.json()["error"]["message"]
