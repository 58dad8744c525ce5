"""Gateway test harness: fake engines, configs, and a gateway served on loopback as
`llmgw gateway` serves it (llmgw.http.connection)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from tests.gateway.fake_upstream import FakeUpstream
from tests.servers import serve_asgi

from llmgw import secrets, wire
from llmgw.gateway.app import Gateway
from llmgw.gateway.link import ControlPlaneLink, MemoryLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.http.connection import LeanHttpProtocol

SECRET = "sk-llmgw-test-key-0123456789abcdefghijklmnop"
# `llmgw gateway` as its own process, and what it logs once it listens.
GATEWAY_COMMAND = (sys.executable, "-m", "llmgw.cli.main", "gateway")
GATEWAY_LISTENING = r"gateway listening on 127\.0\.0\.1:(\d+)"


def endpoint(upstream: FakeUpstream | str, replica_id: str | None = None) -> wire.Endpoint:
    url = upstream if isinstance(upstream, str) else upstream.url
    name = replica_id or (upstream.name if isinstance(upstream, FakeUpstream) else url)
    return wire.Endpoint(replica_id=name, url=url)


def route(
    name: str,
    upstreams: Sequence[FakeUpstream | str] = (),
    **fields: Any,
) -> wire.ModelRoute:
    fields.setdefault("served_name", f"served/{name}")
    return wire.ModelRoute(name=name, endpoints=[endpoint(u) for u in upstreams], **fields)


def api_key(secret: str = SECRET, key_id: str = "k1", **fields: Any) -> wire.ApiKeyInfo:
    return wire.ApiKeyInfo(key_id=key_id, secret_hash=secrets.hash_secret(secret), **fields)


def make_config(
    version: int, routes: Sequence[wire.ModelRoute], keys: Sequence[wire.ApiKeyInfo] | None = None
) -> wire.GatewayConfig:
    return wire.GatewayConfig(
        routing=wire.RoutingTable(version=version, models=list(routes)),
        keys=list(keys) if keys is not None else [api_key()],
    )


def fast_settings(**overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = {
        "usage_flush_s": 0.2,
        "load_report_s": 0.2,
        "queue_wait_s": 5.0,
        "cooldown_s": 2.0,
    }
    values.update(overrides)
    return GatewaySettings(**values)


@asynccontextmanager
async def running_gateway(
    link: ControlPlaneLink, settings: GatewaySettings | None = None, *, wait: bool = True
) -> AsyncIterator[tuple[Gateway, str]]:
    gateway = Gateway(link, settings or fast_settings())
    await gateway.start()
    try:
        if wait:
            assert await gateway.wait_configured(5.0)
        # The protocol `llmgw gateway` serves with.
        async with serve_asgi(gateway, http=LeanHttpProtocol) as url:
            yield gateway, url
    finally:
        await gateway.stop()


_open_clients: list[openai.AsyncOpenAI] = []


def async_client(url: str, key: str = SECRET, timeout: float = 20.0) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)
    _open_clients.append(client)
    return client


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    # Clients left to the garbage collector try to close on a loop that is gone.
    yield
    while _open_clients:
        await _open_clients.pop().close()


def sync_client(url: str, key: str = SECRET) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20.0)


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started fake engines, all stopped at the end of the test."""
    started: list[FakeUpstream] = []

    async def start(name: str, **options: Any) -> FakeUpstream:
        upstream = await FakeUpstream(name, **options).start()
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        await upstream.stop()


@pytest.fixture
def link() -> MemoryLink:
    return MemoryLink(poll_timeout_s=1.0)


def assert_route_not_served(refused: pytest.ExceptionInfo[openai.NotFoundError],
                            route: str) -> None:
    """The gateway's 404 for a model whose engine lacks ``route``: OpenAI's, naming it."""
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"does not serve {route}" in error["message"]
