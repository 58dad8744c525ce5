"""Reading the store's members from Patroni's GET /cluster (3.x and 4.x shapes)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from tests.waiting import eventually

from llmgw.control.adminapi.patroni import (
    LAG_UNKNOWN,
    PatroniFormatError,
    PatroniReader,
    fetch_members,
    parse_cluster,
    patroni_urls_from_env,
)

# Patroni 4.1.5 as measured (research/store-sched.md §1.1), one replica restarting.
PATRONI_4 = {
    "members": [
        {"name": "pg1", "role": "replica", "state": "streaming",
         "api_url": "http://127.0.0.1:18001/patroni", "host": "127.0.0.1", "port": 15431,
         "timeline": 1, "receive_lag": 0, "receive_lsn": "0/5000060", "replay_lag": 0,
         "replay_lsn": "0/5000060", "lag": 120, "lsn": "0/5000060"},
        {"name": "pg0", "role": "leader", "state": "running",
         "api_url": "http://127.0.0.1:18000/patroni", "host": "127.0.0.1", "port": 15430,
         "timeline": 1},
        {"name": "pg2", "role": "quorum_standby", "state": "stopped", "host": "127.0.0.1",
         "port": 15432, "lag": "unknown", "lsn": "unknown", "receive_lag": "unknown"},
    ],
    "scope": "llmgw-test",
    "pause": True,
}

# Debian's 3.0.2: replicas say "running", lag only, a sync standby.
PATRONI_3 = {
    "members": [
        {"name": "a", "role": "leader", "state": "running", "host": "10.0.0.1", "port": 5432,
         "api_url": "http://10.0.0.1:8008/patroni", "timeline": 3},
        {"name": "b", "role": "sync_standby", "state": "running", "host": "10.0.0.2",
         "port": 5432, "timeline": 3, "lag": 0},
        {"name": "c", "role": "replica", "state": "running", "host": "10.0.0.3", "port": 5432},
    ],
}


def test_patroni_4_shape() -> None:
    members = parse_cluster(PATRONI_4)
    assert [(m.name, m.role, m.state, m.lag) for m in members] == [
        ("pg0", "leader", "running", 0),
        ("pg1", "replica", "streaming", 120),
        ("pg2", "quorum_standby", "stopped", LAG_UNKNOWN),
    ]
    assert all(m.host == "127.0.0.1" for m in members)


def test_patroni_3_shape_lag_absent_on_a_replica_is_unknown() -> None:
    members = parse_cluster(PATRONI_3)
    assert [(m.name, m.role, m.lag) for m in members] == [
        ("a", "leader", 0), ("b", "sync_standby", 0), ("c", "replica", LAG_UNKNOWN)
    ]


@pytest.mark.parametrize("document", [[], {"scope": "x"}, {"members": {}},
                                      {"members": [{"role": "leader"}]}, "text"])
def test_documents_that_are_not_a_cluster_are_refused_with_a_reason(document: Any) -> None:
    with pytest.raises(PatroniFormatError):
        parse_cluster(document)


def test_env_holds_one_or_several_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_PATRONI_URL", "http://a:8008/, http://b:8008")
    assert patroni_urls_from_env() == ["http://a:8008", "http://b:8008"]
    monkeypatch.delenv("LLMGW_PATRONI_URL")
    assert patroni_urls_from_env() == []


class FakePatroni:
    def __init__(self) -> None:
        self.document: Any = PATRONI_4
        self.status = 200
        self.calls = 0
        self.url = ""

    async def cluster(self, _: web.Request) -> web.Response:
        self.calls += 1
        if isinstance(self.document, str):
            return web.Response(text=self.document, status=self.status)
        return web.json_response(self.document, status=self.status)


@pytest.fixture
async def patroni() -> AsyncIterator[FakePatroni]:
    fake = FakePatroni()
    app = web.Application()
    app.router.add_get("/cluster", fake.cluster)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


async def test_members_over_http(patroni: FakePatroni) -> None:
    status = await fetch_members([patroni.url])
    assert status.error is None
    assert [m.name for m in status.members] == ["pg0", "pg1", "pg2"]


async def test_unreachable_patroni_gives_the_error_text() -> None:
    url = closed_port_url()
    status = await fetch_members([url], limit_s=2)
    assert status.members == []
    assert status.error is not None and f"{url}/cluster" in status.error


async def test_second_url_is_tried_when_the_first_is_down(patroni: FakePatroni) -> None:
    status = await fetch_members([closed_port_url(), patroni.url])
    assert status.error is None and len(status.members) == 3


async def test_http_error_and_garbage_are_reported(patroni: FakePatroni) -> None:
    patroni.status = 503
    status = await fetch_members([patroni.url])
    assert status.error is not None and "HTTP 503" in status.error
    patroni.status, patroni.document = 200, "<html>not json"
    status = await fetch_members([patroni.url])
    assert status.error is not None and "not JSON" in status.error


async def test_a_patroni_that_never_answers_costs_at_most_the_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        status = await fetch_members([f"http://127.0.0.1:{port}"], limit_s=0.3)
        assert loop.time() - start < 2
        assert status.error is not None and "no answer within 0.3 s" in status.error
    finally:
        server.close()


async def test_reader_caches_and_refreshes_in_the_background(patroni: FakePatroni) -> None:
    reader = PatroniReader([patroni.url], ttl_s=0.05)
    first = await reader.status()
    assert first.error is None and patroni.calls == 1
    await reader.status()
    assert patroni.calls == 1  # within the TTL: no new request
    await asyncio.sleep(0.1)  # past the TTL
    patroni.status = 503
    stale = await reader.status()  # answers at once with what it had, refreshes behind
    assert stale.error is None

    async def refreshed() -> bool:
        return patroni.calls == 2 and (await reader.status()).error is not None

    await eventually(refreshed, 1, "the refresh behind the stale answer", every_s=0.01)
    assert (await reader.status()).error is not None
    await reader.close()


async def test_reader_without_urls_reports_nothing() -> None:
    status = await PatroniReader([]).status()
    assert status.members == [] and status.error is None
