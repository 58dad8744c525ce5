"""The control plane's HTTP routes: schemathesis over the admin API, and raw agent/gateway calls.

A real control plane (SQLite store, a small fleet) on loopback. The admin
API is generated from its OpenAPI document (every operation, the admin
token on each call; an answer must not be 5xx and must match the schema).
The agent and gateway routes are not in that document (they are llmgw's
own wire, not a public API): their bodies are generated from the wire
models' shapes and mutated, sent with no token, a wrong token and the right
one; none may be answered 5xx.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from hypothesis import strategies as st
from tests.fuzz.parsers import _json
from tests.fuzz.runner import Failure, ServerError, Target


@contextlib.contextmanager
def _plane() -> Iterator[Any]:
    from tests.control.adminapi.fleetkit import served_control_plane
    from tests.control.adminapi.test_routes import live_fleet

    with tempfile.TemporaryDirectory() as tmp, served_control_plane(
            Path(tmp), live_fleet().state) as served, httpx.Client(
            base_url=served.url, timeout=10.0) as client:
        served.client = client
        yield served


# -- schemathesis over the admin API ----------------------------------------------------


def _admin_operations(_: Any) -> st.SearchStrategy[Any]:
    from tests.control.adminapi.test_schemathesis import schema

    operations = [result.ok() for result in schema.get_all_operations()]
    return st.one_of([operation.as_strategy() for operation in operations])


def validated(case: Any, base_url: str, headers: dict[str, str], *, statuses: bool = False) -> None:
    """Call a schemathesis case and check its answer: no 5xx, the documented shape and
    content type (and, with ``statuses``, a documented status)."""
    from schemathesis import checks
    from schemathesis.core.failures import FailureGroup

    wanted = [checks.not_a_server_error, checks.response_schema_conformance,
              checks.content_type_conformance]
    if statuses:
        wanted.append(checks.status_code_conformance)
    try:
        case.call_and_validate(base_url=base_url, headers=headers, checks=wanted)
    except FailureGroup as exc:
        text = str(exc)
        if "Server error" in text or " 5" in text.split("\n", 1)[0]:
            raise ServerError(text[:1200]) from None
        raise Failure(text[:1200]) from None
    except AssertionError as exc:
        text = str(exc)
        if "Server error" in text:
            raise ServerError(text[:1200]) from None
        raise Failure(text[:1200]) from None


def _check_admin(served: Any, case: Any) -> None:
    validated(case, served.url, {"Authorization": f"Bearer {served.admin_token}"})


ADMIN = Target("admin_api_schemathesis", _plane, _admin_operations, _check_admin)


# -- schemathesis over the agent API ----------------------------------------------------


@contextlib.contextmanager
def _agent_plane() -> Iterator[Any]:
    from tests.control.test_agent_openapi import NODE

    with _plane() as served:
        served.fuzz_node_token = served.node_token(NODE)
        yield served


def _agent_operations(_: Any) -> st.SearchStrategy[Any]:
    from tests.control.test_agent_openapi import schema

    return st.one_of([result.ok().as_strategy() for result in schema.get_all_operations()])


def _check_agent(served: Any, case: Any) -> None:
    from tests.control.test_agent_openapi import credentials

    validated(case, served.url, credentials(case, served, served.fuzz_node_token))


AGENT = Target("agent_api_schemathesis", _agent_plane, _agent_operations, _check_agent)


# -- agent and gateway routes -----------------------------------------------------------

_ROUTES = ["/agent/v1/register", "/agent/v1/report", "/gateway/v1/load", "/gateway/v1/demand",
           "/gateway/v1/usage", "/gateway/v1/config"]


@st.composite
def _call(draw: st.DrawFn) -> tuple[str, str, str, bytes, dict[str, str]]:
    path = draw(st.sampled_from(_ROUTES))
    method = "GET" if path.endswith("/config") else draw(st.sampled_from(["POST", "POST", "PUT"]))
    who = draw(st.sampled_from(["none", "wrong", "node", "gateway", "join"]))
    shapes = st.one_of(
        st.fixed_dictionaries({}, optional={
            "node": st.one_of(st.just("n1"), st.text(max_size=20), _json),
            "join_token": st.one_of(st.just("JOIN"), st.text(max_size=30), _json),
            "agent_key": st.one_of(st.text(min_size=30, max_size=40), _json),
            "inventory": _json, "replicas": _json, "protocol": _json,
            "address": st.one_of(st.text(max_size=30), _json), "model": _json,
            "agent_port": _json, "weights": _json, "fabrics": _json}).map(orjson.dumps),
        st.lists(_json, max_size=3).map(orjson.dumps),
        st.binary(max_size=80),
        st.sampled_from([b'{"node": "n1", "join_token": "\\ud800"}', b'{"node": "\\u0000"}',
                         b"[" * 5000, b'{"a":' * 3000, b"1e99999"]),
    )
    body = draw(shapes)
    query = draw(st.sampled_from(["", "?after=-1&wait=0", "?after=x", "?wait=-5&after=0",
                                  "?wait=1e308&after=99999999999999999999"]))
    return method, path + (query if path.endswith("/config") else ""), who, body, {}


def _check_call(served: Any, case: tuple[str, str, str, bytes, dict[str, str]]) -> None:
    method, path, who, body, _ = case
    token = {"none": None, "wrong": "llmgw-node-wrong", "node": "llmgw-node-wrong",
             "gateway": served.gateway_token, "join": served.join_token}[who]
    body = body.replace(b"JOIN", served.join_token.encode())
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if "/config" in path:
        # A long poll waits up to a minute for a newer config: a wait, not a hang.
        path = path.replace("wait=1e308", "wait=0")
        if "wait=" not in path:
            path += ("&" if "?" in path else "?") + "wait=0"

    answer = served.client.request(method, path, content=body, headers=headers)
    if answer.status_code >= 500 and answer.status_code != 503:
        raise ServerError(f"{method} {path} ({who}) answered {answer.status_code}:"
                          f" {answer.text[:300]}")


WIRE = Target("agent_and_gateway_routes", _plane, lambda _: _call(), _check_call)
