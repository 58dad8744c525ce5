"""Request limits on llmgw's servers: body caps before the body is read, request
heads bounded in time and size, a connection limit (issue 13)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from tests.control.planekit import opened_plane
from tests.slowclients import assert_slow_heads_cut_off

from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.http.connection import LeanHttpProtocol
from llmgw.http.server import Plain, server_config
from llmgw.serving import start_server

MiB = 1024 * 1024


@asynccontextmanager
async def _served(app: object, **overrides: object) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(server_config(app, log_level="warning", loop="none", **overrides))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = await start_server(server, [sock])
    try:
        yield port
    finally:
        server.should_exit = True
        server.force_exit = True
        await task
        sock.close()


# serve and up listen with llmgw's own protocol (llmgw.http.connection).
@pytest.fixture
async def control(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, NewCredentials, int]]:
    async with opened_plane(tmp_path) as (cp, creds), _served(create_app(cp)) as port:
        yield cp, creds, port


async def _exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 5.0)
    finally:
        writer.close()


async def test_a_64_mib_registration_is_refused_before_its_body_or_token_is_read(
    control: tuple[ControlPlane, NewCredentials, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp, _, port = control
    looked_at: list[str] = []
    real_find = cp.credentials.join_tokens.find
    monkeypatch.setattr(cp.credentials.join_tokens, "find",
                        lambda s: looked_at.append(s) or real_find(s))
    head = (f"POST /agent/v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {64 * MiB}\r\n\r\n").encode()
    started = time.monotonic()
    # Only the head and 1 KB of the 64 MiB are ever sent: the answer must not wait for more.
    answer = await _exchange(port, head, b'{"node": "n1", "join_token": "' + b"x" * 1000)
    assert time.monotonic() - started < 2.0
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer
    assert looked_at == [] and cp.state.nodes == {}


async def test_a_registration_is_refused_on_its_head_before_its_body_is_read(
    control: tuple[ControlPlane, NewCredentials, int],
) -> None:
    cp, creds, port = control
    assert creds.join_token
    revoked, revoked_secret = cp.credentials.join_tokens.create(3600.0)
    cp.credentials.join_tokens.revoke(revoked.id)
    head = (b"POST /agent/v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 1000\r\n")
    # 30 of 1,000 bytes: a route that read the body first would wait for the rest.
    partial = b'{"node": "n1", "join_token": "' + creds.join_token.encode()
    for authorization, why in ((b"", b"Authorization header"),
                               (b"Authorization: Bearer llmgw-join-wrong\r\n", b"invalid"),
                               (f"Authorization: Bearer {revoked_secret}\r\n".encode(),
                                b"revoked")):
        started = time.monotonic()
        answer = await _exchange(port, head + authorization + b"\r\n", partial)
        assert time.monotonic() - started < 2.0
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
        assert why in answer, answer
    assert cp.state.nodes == {}


async def test_a_body_token_other_than_the_heads_is_refused(
    control: tuple[ControlPlane, NewCredentials, int],
) -> None:
    cp, creds, port = control
    _, other = cp.credentials.join_tokens.create(3600.0)
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"http://127.0.0.1:{port}/agent/v1/register",
                                   json={"node": "n1", "join_token": other},
                                   headers={"Authorization": f"Bearer {creds.join_token}"})
    assert answer.status_code == 422, answer.text
    assert "header" in answer.json()["error"]["message"]
    assert cp.state.nodes == {}


@pytest.mark.parametrize("path", ["/agent/v1/register", "/gateway/v1/load", "/admin/v1/apply",
                                  "/admin/v1/keys"])
async def test_chunked_bodies_over_the_limit_are_cut_off(
    control: tuple[ControlPlane, NewCredentials, int], path: str,
) -> None:
    _, creds, port = control
    token = creds.join_token if path == "/agent/v1/register" else creds.admin_token
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    chunk = f"{MiB:x}\r\n".encode() + b" " * MiB + b"\r\n"
    sent = 0
    answer = b""
    with contextlib.suppress(ConnectionError):
        while sent < 64 and not answer:
            writer.write(chunk)
            await writer.drain()
            sent += 1
            with contextlib.suppress(TimeoutError):
                answer = await asyncio.wait_for(reader.read(65536), 0.05)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer
    assert sent <= 10  # refused at the 8 MiB limit, not after everything was sent


async def test_small_bodies_still_work(control: tuple[ControlPlane, NewCredentials, int]) -> None:
    _, creds, port = control
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"http://127.0.0.1:{port}/agent/v1/register",
                                   json={"node": "n1"},
                                   headers={"Authorization": f"Bearer {creds.join_token}"})
    assert answer.status_code == 200, answer.text


async def test_a_request_head_trickled_slowly_is_cut_off(
    control: tuple[ControlPlane, NewCredentials, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(LeanHttpProtocol, "head_timeout_s", 0.5)
    _, _, port = control
    await assert_slow_heads_cut_off(port, "/healthz")
    # Other clients were not disturbed.
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200


async def test_an_oversized_request_head_is_refused(
    control: tuple[ControlPlane, NewCredentials, int],
) -> None:
    _, _, port = control
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n"
    with contextlib.suppress(ConnectionResetError):
        answer = await _exchange(port, head)
        assert answer.startswith(b"HTTP/1.1 400") or answer == b"", answer[:100]


async def test_connections_past_the_limit_get_503() -> None:
    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    async with _served(Plain(app), limit_concurrency=2) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        answer = await _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
        for _, writer in held:
            writer.close()


def test_every_server_uses_the_limits() -> None:
    config = server_config(object())
    assert config.limit_concurrency == 4096 and config.timeout_keep_alive == 30
    assert config.http is LeanHttpProtocol


async def test_an_answers_head_goes_out_with_its_body_or_at_once() -> None:
    """The head is written with the body (one write), yet never waits for a late body."""

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        late = scope["path"] == "/late"
        if scope["method"] == "POST":
            await receive()  # type: ignore[operator]
        headers = [] if late else [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})  # type: ignore[operator]
        if late:
            await asyncio.sleep(2.0)
        await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]

    async with _served(Plain(app)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.read(65536), 3.0)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\nhello"), first
        # A stream's head is not held back until its first event.
        writer.write(b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        head = await asyncio.wait_for(reader.read(65536), 3.0)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
        assert time.monotonic() - started < 1.5
        body = await asyncio.wait_for(reader.read(65536), 5.0)
        assert body == b"5\r\nhello\r\n0\r\n\r\n"
        # 100 Continue still comes before the body is sent.
        writer.write(b"POST /now HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: 2\r\n\r\n")  # fmt: skip
        assert (await asyncio.wait_for(reader.read(65536), 3.0)).startswith(
            b"HTTP/1.1 100 Continue"
        )
        writer.write(b"{}")
        answer = await asyncio.wait_for(reader.read(65536), 3.0)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello"), answer
        writer.close()
