"""The engine guard on loopback: nothing reaches the engine without the key, and all of it with."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.engineguard import EngineGuard
from llmgw.agent.engines.base import EngineTls
from llmgw.agent.guardhead import authorized
from llmgw.servertls import ensure_server_tls

KEY = "engine-key-0123456789abcdefghijklmnopqrstu"


class Upstream:
    """A keyless HTTP server standing in for an engine's open routes: it counts what reaches it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.stream_gone = asyncio.Event()
        self.release = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/stream", self.stream)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        auth = request.headers.get("Authorization")
        self.requests.append((f"{request.method} {request.path}", auth))
        return web.Response(text=f"{request.method} {request.path} {len(body)}")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(("stream", request.headers.get("Authorization")))
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            await resp.write(b"data: first\n\n")
            await self.release.wait()
            await resp.write(b"data: second\n\n")
            for _ in range(200):  # until the client goes away
                await asyncio.sleep(0.02)
                await resp.write(b"data: more\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_gone.set()
            raise
        return resp

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = Upstream()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def guarded(upstream_port: int, **kwargs: object) -> AsyncIterator[tuple[EngineGuard, int]]:
    guard = EngineGuard(KEY, "127.0.0.1", upstream_port, **kwargs)  # type: ignore[arg-type]
    port = await guard.start("127.0.0.1", 0)
    try:
        yield guard, port
    finally:
        guard.close()


def request(path: str = "/v1/models", key: str | None = KEY, body: bytes = b"") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: engine\r\n{auth}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def exchange(port: int, data: bytes, *, read_s: float = 3.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the other side closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), read_s)
    finally:
        writer.close()


def test_the_head_check_takes_exactly_one_bearer_with_the_key() -> None:
    key = KEY.encode()
    head = b"GET / HTTP/1.1\r\nHost: x\r\n"
    assert authorized(head + b"authorization:   bearer " + key, key)
    assert not authorized(head + b"Authorization: Bearer " + key[:-1], key)
    assert not authorized(head + b"Authorization: Basic " + key, key)
    assert not authorized(head + b"X-Authorization: Bearer " + key, key)
    # A second Authorization header: the engine might read the other one.
    two = head + b"Authorization: Bearer " + key + b"\r\nAuthorization: Bearer x"
    assert not authorized(two, key)
    # The request line is not a header, whatever it holds.
    assert not authorized(b"GET /Authorization: Bearer " + key + b" HTTP/1.1", key)


async def test_no_key_or_a_wrong_key_gets_401_and_never_reaches_the_engine(
    upstream: Upstream,
) -> None:
    async with guarded(upstream.port) as (guard, port):
        for data in (request(key=None), request(key="wrong"), request(key=KEY[:-1])):
            answer = await exchange(port, data)
            assert answer.startswith(b"HTTP/1.1 401 "), answer
            assert b"invalid_api_key" in answer
        assert upstream.requests == []
        assert guard.stats.refused == 3


async def test_a_refused_head_request_gets_a_401_without_a_body(upstream: Upstream) -> None:
    async with guarded(upstream.port) as (_, port):
        answer = await exchange(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401 ") and answer.endswith(b"\r\n\r\n")


async def test_a_key_on_a_later_request_only_gets_nothing(upstream: Upstream) -> None:
    async with guarded(upstream.port) as (_, port):
        answer = await exchange(port, request(key=None) + request("/v1/chat/completions"))
    assert answer.startswith(b"HTTP/1.1 401 ") and answer.count(b"HTTP/1.1") == 1
    assert upstream.requests == []


async def test_pipelined_requests_after_the_key_all_reach_the_engine(upstream: Upstream) -> None:
    async with guarded(upstream.port) as (guard, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # One write: the first request proves the key, the next two ride on it
        # (the last without a key at all: the connection is the gateway's).
        writer.write(request("/a", body=b"xyz") + request("/b") + request("/c", key=None))
        got = b""
        while got.count(b"HTTP/1.1 200") < 3:
            got += await asyncio.wait_for(reader.read(65536), 3.0)
        writer.close()
    assert [r[0] for r in upstream.requests] == ["POST /a", "POST /b", "POST /c"]
    # Nothing is rewritten: the engine sees the key itself (its own second lock).
    assert upstream.requests[0][1] == f"Bearer {KEY}"
    assert guard.stats.accepted == 1


async def test_a_slow_head_is_cut_off(upstream: Upstream) -> None:
    async with guarded(upstream.port, head_timeout_s=0.3) as (_, port):
        began = time.monotonic()
        answer = await exchange(port, b"POST /v1/models HTTP/1.1\r\nHost: x\r\n")
        assert time.monotonic() - began < 2.0
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert upstream.requests == []


async def test_a_huge_head_is_refused_before_it_ends(upstream: Upstream) -> None:
    async with guarded(upstream.port, head_limit=4096) as (_, port):
        answer = await exchange(port, b"GET / HTTP/1.1\r\nX: " + b"a" * 8192)
        assert answer.startswith(b"HTTP/1.1 431 ")
        # A complete head over the limit, the key in it, is refused as well.
        padded = request().replace(b"Host:", b"X: " + b"a" * 5000 + b"\r\nHost:")
        assert (await exchange(port, padded)).startswith(b"HTTP/1.1 431 ")
    assert upstream.requests == []


async def test_a_stream_passes_through_as_it_comes_and_a_client_that_leaves_ends_it(
    upstream: Upstream,
) -> None:
    async with guarded(upstream.port) as (guard, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("/stream"))
        head = await asyncio.wait_for(reader.readuntil(b"data: first\n\n"), 3.0)
        assert head.startswith(b"HTTP/1.1 200")  # before the engine wrote its second chunk
        upstream.release.set()
        await asyncio.wait_for(reader.readuntil(b"data: second\n\n"), 3.0)
        writer.close()
        await asyncio.wait_for(upstream.stream_gone.wait(), 3.0)
        await asyncio.sleep(0.05)
        assert guard.connections == 0


async def test_an_engine_that_is_down_gets_502_at_once() -> None:
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]  # bound, never listening: refused
        async with guarded(dead) as (guard, port):
            began = time.monotonic()
            answer = await exchange(port, request())
            assert time.monotonic() - began < 1.0
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert guard.stats.unreachable == 1


async def test_the_official_http_client_works_through_it_with_the_key_and_tls(
    upstream: Upstream, tmp_path: Path
) -> None:
    server = ensure_server_tls(tmp_path, ["127.0.0.1"])
    files = EngineTls(cert_file=str(server.cert_file), key_file=str(server.key_file))
    assert server.ca_file is not None
    client_ssl = ssl.create_default_context(cafile=str(server.ca_file))
    async with guarded(upstream.port, tls=files) as (_, port), aiohttp.ClientSession() as s:
        url = f"https://127.0.0.1:{port}/v1/pooling"
        async with s.post(url, data=b"{}", ssl=client_ssl) as resp:
            assert resp.status == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        for _ in range(3):  # kept alive: one connection, one check
            async with s.post(url, data=b"{}", ssl=client_ssl, headers=headers) as resp:
                assert resp.status == 200
                assert await resp.text() == "POST /v1/pooling 2"
