"""The gateway connects to a replica when the routing table adds it, not at its first request.

Real engines on loopback (aiohttp servers, tests.gateway.fake_upstream)
count the connections open to them, so what is checked is what an engine
sees: one connection before any request, the first request on it, and
nothing held open to a hosted API.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest
from tests.gateway.conftest import async_client, make_config, route, running_gateway
from tests.gateway.fake_upstream import FakeUpstream
from tests.gateway.test_external import external_route
from tests.waiting import eventually

from llmgw.gateway.link import MemoryLink
from llmgw.http.client import Pool

MESSAGES: Any = [{"role": "user", "content": "hello"}]


async def _until(check: Callable[[], bool]) -> None:
    await eventually(check, within_s=5.0, every_s=0.01, what="the engines' connection counts")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_first_request_uses_the_connection_opened_for_the_new_replica(
    upstreams: Callable[..., Any], link: MemoryLink
) -> None:
    engine: FakeUpstream = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (_, url):
        await _until(lambda: engine.connections == 1)
        client = async_client(url)
        for _ in range(3):
            answer = await client.chat.completions.create(model="m", messages=MESSAGES)
            assert answer.choices[0].message.content
        assert len(engine.seen) == 3
        assert engine.connections == 1  # every request on the one opened ahead


async def test_a_config_connects_to_the_replicas_it_adds_only(
    upstreams: Callable[..., Any], link: MemoryLink
) -> None:
    first: FakeUpstream = await upstreams("e1")
    second: FakeUpstream = await upstreams("e2")
    link.publish(make_config(1, [route("m", [first])]))
    async with running_gateway(link) as (gateway, _):
        await _until(lambda: first.connections == 1)
        assert second.connections == 0
        link.publish(make_config(2, [route("m", [first, second])]))
        await _until(lambda: second.connections == 1)
        # A second model on the same engine is the same address: no second connection.
        link.publish(make_config(3, [route("m", [first, second]), route("n", [first])]))
        await _until(lambda: gateway.runtime.snapshot is not None
                     and gateway.runtime.snapshot.version == 3)  # fmt: skip
        await asyncio.sleep(0.2)
        assert (first.connections, second.connections) == (1, 1)


async def test_a_replica_that_refuses_is_not_held_against_it(
    upstreams: Callable[..., Any], link: MemoryLink
) -> None:
    live: FakeUpstream = await upstreams("live")
    dead = f"http://127.0.0.1:{_closed_port()}"
    link.publish(make_config(1, [route("m", [live, dead])]))
    async with running_gateway(link) as (gateway, _):
        await _until(lambda: live.connections == 1)
        await asyncio.sleep(0.1)  # the refused connect returned long since
        snapshot = gateway.runtime.snapshot
        assert snapshot is not None
        replica = snapshot.replicas[dead]
        # Not cooled down, no failure counted: requests decide that, not warming.
        assert (replica.failures, replica.cooled_until) == (0, 0.0)


async def test_a_hosted_apis_url_is_not_connected_ahead(
    upstreams: Callable[..., Any], link: MemoryLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The health prober connects to a hosted API on its own (llmgw.gateway.health),
    # so what is checked is what the gateway's pool was asked to warm.
    warmed: list[int] = []
    warm = Pool.warm

    async def spy(pool: Pool, host: str, port: int, tls: Any = None) -> bool:
        warmed.append(port)
        return await warm(pool, host, port, tls)

    monkeypatch.setattr(Pool, "warm", spy)
    engine: FakeUpstream = await upstreams("engine")
    hosted: FakeUpstream = await upstreams("hosted")
    link.publish(make_config(1, [route("m", [engine]), external_route("team", [hosted.url])]))
    async with running_gateway(link) as _:
        await _until(lambda: engine.connections == 1)
        await asyncio.sleep(0.1)
        assert warmed == [engine.port]


async def test_the_pool_keeps_one_idle_connection_and_none_once_closed(
    upstreams: Callable[..., Any],
) -> None:
    engine: FakeUpstream = await upstreams("e1")
    pool = Pool(connect_timeout_s=2.0, deadline_s=10.0)
    assert await pool.warm("127.0.0.1", engine.port)
    assert await pool.warm("127.0.0.1", engine.port)  # one is idle already
    await _until(lambda: engine.connections == 1)
    assert not await pool.warm("127.0.0.1", _closed_port())
    pool.close()
    assert not await pool.warm("127.0.0.1", engine.port)
    await _until(lambda: engine.connections == 0)
