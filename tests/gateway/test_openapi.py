"""The gateway's OpenAPI document: true to its route table and envelopes, served without a key,
and every operation fuzzed from it (schemathesis) against a real gateway with a simulated
engine behind: no 5xx, answers of the documented statuses, shapes and content types.
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
from tests.fuzz.gateway import _Running, _setup
from tests.gateway.conftest import fast_settings

from llmgw.gateway.app import Gateway
from llmgw.gateway.checks.validation import ENVELOPES
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.openapi import DOCUMENT, OPENAPI_PATH

SERVED_MODEL = "m"  # the fuzz gateway's one model, a simulated engine


@pytest.fixture(scope="module")
def gateway() -> Iterator[_Running]:
    with _setup() as running:
        yield running


async def test_the_document_has_every_route_of_the_gateway() -> None:
    routes = {(method, path) for method, path in Gateway(MemoryLink(), fast_settings()).routes()
              if path.startswith("/v1")}
    documented = {(method.upper(), path) for path, item in DOCUMENT["paths"].items()
                  for method in item}
    assert documented == routes


def test_each_required_field_is_one_the_gateway_requires(gateway: _Running) -> None:
    headers = {"Authorization": f"Bearer {gateway.key}"}
    for path, envelope in ENVELOPES.items():
        body = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]
        schema = next(iter(body.values()))["schema"]
        assert schema["required"] == list(envelope.required)
        assert set(schema["properties"]) == set(envelope.fields)
        if "application/json" not in body:
            continue
        answer = gateway.client.post(path, json={}, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == envelope.required[0]


def test_the_document_is_served_without_a_key(gateway: _Running) -> None:
    answer = httpx.get(gateway.url + OPENAPI_PATH, timeout=10)
    assert answer.status_code == 200 and answer.json() == DOCUMENT


schema = schemathesis.openapi.from_dict(DOCUMENT)


@schema.parametrize()
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_gateway_api_never_fails_on_generated_requests(case: Case[Any], gateway: _Running) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = SERVED_MODEL  # to the engine, where a request goes furthest
    case.call_and_validate(
        base_url=gateway.url, headers={"Authorization": f"Bearer {gateway.key}"},
        checks=[checks.not_a_server_error, checks.status_code_conformance,
                checks.response_schema_conformance, checks.content_type_conformance],
    )
