"""Every route of every llmgw server, with every credential → allowed or refused (issue 13).

Three servers listen on a fleet's network: the control plane (and the
built-in gateway that shares its port under ``serve``), a gateway, and each
agent's own server (peer weights, nudges, /metrics). The table of who may
call what is generated from the routes each one actually mounts: a new route
without an entry in its ACCESS table fails this test until someone decides
which credential it takes. Every credential is real, made by the control
plane (the agent's peer token came to it in a report answer).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route
from tests.control.planekit import KEY, inventory, opened_plane, register
from tests.servers import serve_asgi

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.app import create_app
from llmgw.control.gateway_link import InProcessLink
from llmgw.gateway.app import Gateway
from llmgw.gateway.settings import GatewaySettings
from llmgw.servertls import CaRoute, ensure_server_tls
from llmgw.tls import CA_PATH
from llmgw.wire import AgentReport, ModelSpec

CREDENTIALS = ["none", "api key", "gateway token", "node token", "other node token",
               "agent key", "join token", "admin token", "peer token", "engine key"]
ALLOWED = {
    "open": set(CREDENTIALS),
    "node": {"node token"},
    "gateway": {"gateway token", "admin token"},  # an operator may run a gateway by hand
    "admin": {"admin token"},
    "api": {"api key"},
    "peer": {"peer token"},
}

# Path pattern -> which credential opens it, per server.
CONTROL_ACCESS: list[tuple[str, str]] = [
    (r"^/healthz(/leader)?$", "open"),
    (r"^/metrics$", "open"),  # open unless a metrics token is set (test_metrics_token.py)
    (r"^/agent/v1/openapi\.json$", "open"),  # the agent API's schema, as the admin API's
    (r"^/agent/v1/register$", "join"),  # the join token, in the head like the others
    (r"^/agent/v1/report$", "node"),
    (r"^/gateway/v1/", "gateway"),
    (r"^/admin/v1/openapi\.json$", "open"),  # the schema, as published with the source
    (r"^/admin/v1/", "admin"),
    (r"^/console(/|$)", "open"),  # static page; it reads everything through /admin/v1
    (rf"^{re.escape(CA_PATH)}$", "open"),  # public, like any CA certificate
]
GATEWAY_ACCESS: list[tuple[str, str]] = [
    (r"^/v1/(chat/completions|completions|embeddings)$", "api"),
    # Passed through to engines that serve them (issue 17): the same API keys.
    (r"^/v1/(responses|rerank|score|audio/transcriptions)$", "api"),
    (r"^/v1/models(/\{model\})?$", "api"),
    (r"^/v1/openapi\.json$", "open"),  # the API's schema, the same for everyone
    (r"^/metrics$", "open"),  # as the control plane's
    (r"^/healthz?$", "open"),
]
AGENT_ACCESS: list[tuple[str, str]] = [
    (r"^/agent/v1/health$", "open"),
    (r"^/metrics$", "open"),  # the metrics token when set (test_agent_metrics.py)
    (r"^/agent/v1/weights/", "peer"),  # licensed or private weights
    (r"^/agent/v1/nudge$", "peer"),  # the control plane holds the peer token too
]


def _kind(access: list[tuple[str, str]], path: str) -> str:
    for pattern, kind in access:
        if re.search(pattern, path):
            return kind
    raise AssertionError(f"route {path} has no entry in ACCESS: decide who may call it")


def _control_routes(routes: Any, prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for route in routes:
        if isinstance(route, APIRoute | Route):
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    out.append((method, prefix + route.path))
        elif isinstance(route, Mount):
            out.append(("GET", prefix + route.path + "/app.js"))
        elif hasattr(route, "original_router"):  # FastAPI's include_router, kept lazily
            out += _control_routes(route.original_router.routes,
                                   prefix + route.include_context.prefix)
        else:
            raise AssertionError(f"unexpected route type {type(route).__name__}")
    return out


def _concrete(path: str) -> str:
    values = {"name": "n1", "replica_id": "r1", "key_id": "nope", "token_id": "nope",
              "model": "m"}
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values.get(m.group(1), "x"), path)


@dataclass
class Fleet:
    tokens: dict[str, str]
    control: tuple[str, list[tuple[str, str]]]
    gateway: tuple[str, list[tuple[str, str]]]
    agent: tuple[str, list[tuple[str, str]]]


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with opened_plane(tmp_path) as (cp, creds):
        await cp.catalog.put([ModelSpec(name="m", engine="sim")])
        gateway = Gateway(InProcessLink(cp), GatewaySettings())
        await gateway.start()
        assert await gateway.wait_configured(10)
        # As serve mounts it under TLS: the CA route in front of the control plane.
        ca = ensure_server_tls(tmp_path / "tls", ["127.0.0.1"])
        control = CaRoute(create_app(cp), ca.ca_pem() or b"")
        agent: Agent | None = None
        try:
            async with (serve_asgi(control) as url, serve_asgi(gateway.asgi) as gateway_url,
                        httpx.AsyncClient() as client):
                assert creds.join_token and creds.admin_token and creds.gateway_token
                assert creds.api_key
                tokens = {
                    "api key": creds.api_key,
                    "gateway token": creds.gateway_token,
                    "node token": await register(client, url, creds.join_token, "n1", KEY),
                    "other node token": await register(client, url, creds.join_token, "n2"),
                    "agent key": KEY,
                    "join token": creds.join_token,
                    "admin token": creds.admin_token,
                    "peer token": cp.peer_token,
                    "engine key": cp.engine_keys.key("r1"),
                }
                agent = Agent(AgentConfig(control_plane=url, data_dir=tmp_path / "n3", name="n3",
                                          join_token=creds.join_token, memory_guard="off"),
                              inventory_provider=lambda: inventory("n3"), adapters={})
                await agent.report_once()  # registers, and learns the peer token
                server = agent.server
                assert server is not None
                control_routes = [*_control_routes(create_app(cp).routes), ("GET", CA_PATH)]
                yield Fleet(
                    tokens,
                    (url, control_routes),
                    (gateway_url, gateway.routes()),
                    (f"http://127.0.0.1:{server.port}", server.routes()),
                )
        finally:
            if agent is not None:
                await agent.shutdown()
            await gateway.stop()


# Routes that replace a credential, and which one.
ROTATES = {"/admin/v1/admin-token/rotate": "admin token",
           "/admin/v1/gateway-token/rotate": "gateway token"}


def _control_body(path: str) -> Any:
    if path == "/agent/v1/report":
        return AgentReport(node="n1", inventory=inventory("n1")).model_dump(mode="json")
    if path == "/gateway/v1/usage":
        return []
    if path == "/gateway/v1/load":
        return {"gateway_id": "g", "replicas": []}
    if path == "/gateway/v1/demand":
        return {"model": "m"}
    return {}


async def _check(
    base: str, routes: list[tuple[str, str]], access: list[tuple[str, str]],
    tokens: dict[str, str], body: Callable[[str], Any] = lambda path: {},
) -> int:
    checked = 0
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, template in routes:
            kind = _kind(access, template)
            path = _concrete(template)
            for credential in CREDENTIALS:
                token = tokens.get(credential)
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                payload: Any = {"node": "n9"} if kind == "join" else body(path)
                path_q = path + "?wait=0" if path == "/gateway/v1/config" else path
                answer = await client.request(method, path_q, headers=headers,
                                              json=payload if method != "GET" else None)
                if answer.status_code == 200 and path in ROTATES:
                    # The credential just used was replaced: carry on with the new one.
                    tokens[ROTATES[path]] = answer.json()["token"]
                refused = answer.status_code in (401, 403)
                allowed = (credential == "join token") if kind == "join" else (
                    credential in ALLOWED[kind])
                assert refused != allowed, (base, method, path, credential,
                                            answer.status_code, answer.text[:200])
                checked += 1
    return checked


async def test_every_control_plane_route_takes_only_its_credential(fleet: Fleet) -> None:
    url, routes = fleet.control
    assert len(routes) > 40  # the admin API is there
    checked = await _check(url, routes, CONTROL_ACCESS, fleet.tokens, _control_body)
    assert checked == len(routes) * len(CREDENTIALS)


async def test_every_gateway_route_takes_only_its_credential(fleet: Fleet) -> None:
    url, routes = fleet.gateway
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
    assert {("POST", "/v1/responses"), ("POST", "/v1/rerank"), ("POST", "/v1/score"),
            ("POST", "/v1/audio/transcriptions")} <= set(routes)
    checked = await _check(url, routes, GATEWAY_ACCESS, fleet.tokens)
    assert checked == len(routes) * len(CREDENTIALS)


async def test_every_agent_route_takes_only_its_credential(fleet: Fleet) -> None:
    url, routes = fleet.agent
    assert ("POST", "/agent/v1/nudge") in routes and ("GET", "/metrics") in routes
    checked = await _check(url, routes, AGENT_ACCESS, fleet.tokens)
    assert checked == len(routes) * len(CREDENTIALS)


def test_a_route_without_an_entry_fails_the_matrix() -> None:
    with pytest.raises(AssertionError, match="no entry in ACCESS"):
        _kind(GATEWAY_ACCESS, "/v2/new")
    with pytest.raises(AssertionError, match="no entry in ACCESS"):
        _kind(GATEWAY_ACCESS, "/v1/audio/speech")
    with pytest.raises(AssertionError, match="no entry in ACCESS"):
        _kind(AGENT_ACCESS, "/agent/v1/debug")
