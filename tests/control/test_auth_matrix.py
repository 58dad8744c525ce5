"""Every route the control plane mounts, with every credential → allowed or refused (issue 13).

The table of who may call what is generated from the routes actually mounted:
a new route without an entry in ACCESS fails this test until someone decides
which credential it takes.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route
from tests.control.test_agent_api import KEY, inventory, register
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.service import ControlPlane
from llmgw.wire import AgentReport, ModelSpec

# Path pattern -> which credential opens it.
ACCESS: list[tuple[str, str]] = [
    (r"^/healthz(/leader)?$", "open"),
    (r"^/metrics$", "open"),  # open unless a metrics token is set (test_metrics_token.py)
    (r"^/agent/v1/register$", "join"),  # the join token travels in the body
    (r"^/agent/v1/report$", "node"),
    (r"^/gateway/v1/", "gateway"),
    (r"^/admin/v1/openapi\.json$", "open"),  # the schema, as published with the source
    (r"^/admin/v1/", "admin"),
    (r"^/console(/|$)", "open"),  # static page; it reads everything through /admin/v1
]

CREDENTIALS = ["none", "api key", "gateway token", "node token", "other node token",
               "agent key", "join token", "admin token"]
ALLOWED = {
    "open": set(CREDENTIALS),
    "node": {"node token"},
    "gateway": {"gateway token", "admin token"},  # an operator may run a gateway by hand
    "admin": {"admin token"},
}


def _kind(path: str) -> str:
    for pattern, kind in ACCESS:
        if re.search(pattern, path):
            return kind
    raise AssertionError(f"route {path} has no entry in ACCESS: decide who may call it")


def _mounted(routes: Any, prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for route in routes:
        if isinstance(route, APIRoute | Route):
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    out.append((method, prefix + route.path))
        elif isinstance(route, Mount):
            out.append(("GET", prefix + route.path + "/app.js"))
        elif hasattr(route, "original_router"):  # FastAPI's include_router, kept lazily
            out += _mounted(route.original_router.routes,
                            prefix + route.include_context.prefix)
        else:
            raise AssertionError(f"unexpected route type {type(route).__name__}")
    return out


def _concrete(path: str) -> str:
    values = {"name": "n1", "replica_id": "r1", "key_id": "nope", "token_id": "nope"}
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values.get(m.group(1), "x"), path)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Any, ControlPlane, dict[str, str], str]]:
    from llmgw.control.store.repo import Store

    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    await cp.put_models([ModelSpec(name="m", engine="sim")])
    app = create_app(cp)
    async with serve_asgi(app) as url, httpx.AsyncClient() as client:
        assert creds.join_token and creds.admin_token and creds.gateway_token and creds.api_key
        tokens = {
            "api key": creds.api_key,
            "gateway token": creds.gateway_token,
            "node token": await register(client, url, creds.join_token, "n1", KEY),
            "other node token": await register(client, url, creds.join_token, "n2"),
            "agent key": KEY,
            "join token": creds.join_token,
            "admin token": creds.admin_token,
        }
        yield app, cp, tokens, url
    await store.close()


def _body(path: str) -> Any:
    if path == "/agent/v1/report":
        return AgentReport(node="n1", inventory=inventory("n1")).model_dump(mode="json")
    if path == "/gateway/v1/usage":
        return []
    if path == "/gateway/v1/load":
        return {"gateway_id": "g", "replicas": []}
    if path == "/gateway/v1/demand":
        return {"model": "m"}
    return {}


async def test_every_route_takes_only_its_credential(
    served: tuple[Any, ControlPlane, dict[str, str], str],
) -> None:
    app, _, tokens, url = served
    routes = _mounted(app.routes)
    assert len(routes) > 40  # the admin API is there
    checked = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for method, template in routes:
            kind = _kind(template)
            path = _concrete(template)
            for credential in CREDENTIALS:
                if kind == "join":
                    body: Any = {"node": "n9", "join_token": tokens.get(credential, "none")}
                    headers = {}
                else:
                    body = _body(path)
                    token = tokens.get(credential)
                    headers = {"Authorization": f"Bearer {token}"} if token else {}
                path_q = path + "?wait=0" if path == "/gateway/v1/config" else path
                answer = await client.request(method, path_q, headers=headers,
                                              json=body if method != "GET" else None)
                refused = answer.status_code in (401, 403)
                allowed = (credential == "join token") if kind == "join" else (
                    credential in ALLOWED[kind])
                assert refused != allowed, (method, path, credential, answer.status_code,
                                            answer.text[:200])
                checked += 1
    assert checked == len(routes) * len(CREDENTIALS)
