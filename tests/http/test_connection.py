"""llmgw's own HTTP/1.1 server protocol (llmgw.http.connection) on real loopback sockets.

tests/http/test_server_protocol.py compares its scopes and answer bytes
with uvicorn's; these check what a byte comparison cannot: the limits
(head size and deadline, connections), request bodies in pieces, a client
that leaves, backpressure, graceful shutdown, TLS and the access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from tests.servers import read_body
from tests.slowclients import assert_slow_heads_cut_off

from llmgw.http.connection import LeanHttpProtocol
from llmgw.http.contract import HEADERS_EXTENSION, Receive, Scope, Send
from llmgw.http.server import Plain, server_config
from llmgw.servertls import ensure_server_tls
from llmgw.serving import start_server


@asynccontextmanager
async def _served(app: Any, **settings: Any) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = server_config(Plain(app), **{"log_level": "warning", "loop": "none", **settings})
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = await start_server(server, [sock])
    try:
        yield int(sock.getsockname()[1]), server
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the request's body (all of it) and its headers' index."""
    body = await read_body(receive)
    index = scope["extensions"][HEADERS_EXTENSION]
    answer = body + b"|" + b",".join(sorted(index))
    headers = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_chunked_body_in_pieces_arrives_whole() -> None:
    async with _served(_echo) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"X-Some: Value  \r\n\r\n3\r\nabc\r\n")  # fmt: skip
        await asyncio.sleep(0.05)
        writer.write(b"2\r\nde\r\n0\r\n\r\n")
        head, body = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert body == b"abcde|host,transfer-encoding,x-some"
        writer.close()


async def test_a_head_over_the_cap_is_refused_and_one_under_it_with_a_large_body_is_not() -> None:
    async with _served(_echo) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = b"a" * (60 * 1024)
        body = b"b" * (200 * 1024)
        # Head and body in one write: the reads that hold both are over 64 KiB.
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nX-Big: " + big
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        head, answer = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and answer.startswith(body)
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            answer = await asyncio.wait_for(reader.read(65536), 5)
            assert answer.startswith(b"HTTP/1.1 400") or answer == b"", answer[:100]
        writer.close()

        # A head that never ends is cut once it passes the cap, not buffered on.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(20):
                writer.write(b"a" * 8192)
                await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 5)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        writer.close()


async def test_a_slow_head_and_an_idle_connection_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LeanHttpProtocol, "head_timeout_s", 0.5)
    async with _served(_echo) as (port, _):
        await assert_slow_heads_cut_off(port, "/x")


async def test_a_long_answer_is_not_cut_by_the_head_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(LeanHttpProtocol, "head_timeout_s", 0.3)

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(4):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with _served(slow) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.wait_for(reader.read(65536), 3)
            assert chunk, data
            data += chunk
        assert data.count(b"1\r\nx\r\n") == 4
        writer.close()


async def test_connections_past_the_limit_get_503() -> None:
    async with _served(_echo, limit_concurrency=2) as (port, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(65536), 5)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
        for _, other in held:
            other.close()
        writer.close()


async def test_a_malformed_request_gets_400() -> None:
    async with _served(_echo) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 400") and answer.endswith(
            b"Invalid HTTP request received."
        )
        writer.close()


async def test_100_continue_comes_before_the_body() -> None:
    async with _served(_echo) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\n"
                     b"Content-Length: 2\r\n\r\n")  # fmt: skip
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"{}")
        _, body = await _read_answer(reader)
        assert body.startswith(b"{}|")
        writer.close()


async def test_a_client_that_leaves_is_told_to_the_app() -> None:
    told = asyncio.get_running_loop().create_future()

    async def waits(scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()
        assert first["type"] == "http.request" and first["body"] == b"hi"
        told.set_result((await receive())["type"])

    async with _served(waits) as (port, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        await asyncio.sleep(0.1)
        writer.close()
        assert await asyncio.wait_for(told, 3) == "http.disconnect"


async def test_a_stream_to_a_client_that_does_not_read_waits_for_it() -> None:
    sent: list[int] = []
    piece = b"z" * (1 << 20)

    async def streams(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % (64 * len(piece)))]})  # fmt: skip
        for i in range(64):
            await send({"type": "http.response.body", "body": piece, "more_body": i < 63})
            sent.append(i)

    async with _served(streams) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        # The kernel's buffers and the transport's take a few MiB, not 64.
        assert len(sent) < 48
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert len(await asyncio.wait_for(reader.readexactly(64 * len(piece)), 10)) == 64 << 20
        assert len(sent) == 64
        writer.close()


async def test_a_graceful_stop_finishes_answers_and_closes_idle_connections() -> None:
    release = asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    async with _served(slow) as (port, server):
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        await _read_answer(idle_reader)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        server.should_exit = True
        # The idle connection closes at once; the busy one answers, then closes.
        assert await asyncio.wait_for(idle_reader.read(), 3) == b""
        await asyncio.sleep(0.2)
        release.set()
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        assert answer.endswith(b"ok")
        writer.close()
        idle_writer.close()


async def test_tls(tmp_path: Path) -> None:
    tls = ensure_server_tls(tmp_path / "tls", ["127.0.0.1"])
    assert tls.ca_file is not None
    client = ssl.create_default_context(cafile=str(tls.ca_file))
    async with _served(_echo, **tls.uvicorn_settings()) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        for _ in range(2):
            writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            head, body = await _read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and body.startswith(b"abc|")
        writer.close()


async def test_the_access_log() -> None:
    lines: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    async with _served(_echo, access_log=True, log_level="info") as (port, _):
        kept = Kept()
        access.addHandler(kept)  # before the connection: its protocol looks once
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /logged?q=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            await _read_answer(reader)
            writer.close()
        finally:
            access.removeHandler(kept)
    assert any("GET /logged?q=1 HTTP/1.1" in line and "200" in line for line in lines), lines


async def test_answers_and_streams_without_asgi_messages_read_as_uvicorns_would() -> None:
    async def direct(scope: Scope, receive: Receive, send: Any) -> None:
        await receive()
        if scope["path"] == "/whole":
            send.answer(201, [(b"content-type", b"text/plain"), (b"x-a", b"1")], b"hello")
            return
        send.start(200, [(b"content-type", b"text/event-stream")])
        await send.stream(b"")  # the head alone, before a wait
        await asyncio.sleep(0.05)
        await send.stream(b"data: 1\n\n")
        await send.stream(b"data: 2\n\n", False)

    async with _served(direct) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /whole HTTP/1.1\r\nHost: x\r\n\r\nHEAD /whole HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        head, body = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 201 Created\r\ndate: ")
        assert head.endswith(b"content-type: text/plain\r\nx-a: 1\r\ncontent-length: 5\r\n\r\n")
        assert body == b"hello"
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"content-length: 5" in head  # HEAD: the length, no body
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        assert data.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n" in data
        assert data.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        writer.close()


def test_the_gateway_and_serve_listen_with_it_and_llmgws_limits() -> None:
    config = server_config(Plain(_echo))
    assert config.http is LeanHttpProtocol
    assert config.limit_concurrency == 4096 and config.timeout_keep_alive == 30
    for module in ("llmgw.cli.gateway", "llmgw.cli.combined"):
        source = Path(__import__(module, fromlist=["_"]).__file__ or "").read_text()
        assert "server_config(" in source, module


async def test_an_app_that_asks_is_cancelled_when_its_client_leaves() -> None:
    ended: dict[str, str] = {}

    async def waits(scope: Scope, receive: Receive, send: Any) -> None:
        await receive()
        if scope["path"] == "/watched":
            send.cancel_if_gone()
        try:
            await asyncio.sleep(1.0)
            ended[scope["path"]] = "slept"
        except asyncio.CancelledError:
            ended[scope["path"]] = "cancelled"
            raise

    async with _served(waits) as (port, _):
        for path in ("/watched", "/unwatched"):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await asyncio.sleep(0.1)
            writer.close()
        await asyncio.sleep(1.3)
    assert ended == {"/watched": "cancelled", "/unwatched": "slept"}


async def test_headers_are_lower_cased_and_stripped_as_uvicorn_does() -> None:
    async def shows(scope: Scope, receive: Receive, send: Any) -> None:
        await receive()
        send.answer(200, [], repr(scope["headers"]).encode())

    async with _served(shows) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Trail: a b \t\r\nX-Dup: 1\r\nx-dup: 2\r\n\r\n"
        )
        _, body = await _read_answer(reader)
        assert (
            body
            == repr(
                [(b"host", b"x"), (b"x-trail", b"a b"), (b"x-dup", b"1"), (b"x-dup", b"2")]
            ).encode()
        )
        writer.close()


async def test_a_requests_task_is_named_or_made_by_the_loops_task_factory() -> None:
    names: list[str] = []

    async def named(scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        names.append(task.get_name() if task is not None else "")
        await _echo(scope, receive, send)

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop = asyncio.get_running_loop()
    for chosen in (None, factory):
        loop.set_task_factory(chosen)
        try:
            async with _served(named) as (port, _):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                assert (await _read_answer(reader))[0].startswith(b"HTTP/1.1 200")
                writer.close()
        finally:
            loop.set_task_factory(None)
    # Named, not "Task-<n>" (a name formatted per request); a factory's own otherwise.
    assert names[0] == "llmgw-request" and names[1].startswith("Task-")
