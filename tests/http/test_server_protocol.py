"""llmgw's server protocol (llmgw.http.connection) against uvicorn's own.

The gateway's other tests serve it with uvicorn's stock protocol; these
check what llmgw's protocol does differently per request (a plain path not
parsed by httptools, the keep-alive timer armed once per connection, the
head held for the body, heads written without a per-header loop) leaves the
ASGI scope, the answers' bytes, keep-alive and pipelining as uvicorn has them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from tests.servers import read_body

from llmgw.http.connection import LeanHttpProtocol
from llmgw.http.contract import Receive, Scope, Send
from llmgw.http.server import Plain, server_config
from llmgw.serving import start_server


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the parts of its scope a URL decides."""
    body = await read_body(receive)
    seen = {
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": scope["raw_path"].decode("latin-1"),
        "query_string": scope["query_string"].decode("latin-1"),
        "http_version": scope["http_version"],
        "body": body.decode(),
    }
    data = json.dumps(seen).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


@contextlib.asynccontextmanager
async def _served(**settings: Any) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = server_config(Plain(_echo), log_level="warning", loop="none", **settings)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = await start_server(server, [sock])
    try:
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _answer(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    answer: dict[str, Any] = json.loads(await reader.readexactly(length))
    return answer


def _request(target: str, body: bytes = b"", version: str = "1.1") -> bytes:
    return (
        f"POST {target} HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


URLS = [
    "/v1/chat/completions",
    "/v1/models/a%2Fb",
    "/search?q=1&r=caf%C3%A9",
    "/caf%C3%A9/x",
    "/page#fragment",
    "/page?x=1#fragment",
    "http://example.com/absolute?y=2",
    "/",
    "//double",
]


_COMPARED = (("lean", LeanHttpProtocol), ("uvicorn", "httptools"))


async def test_the_scope_of_each_url_is_uvicorns() -> None:
    seen: dict[str, list[dict[str, Any]]] = {}
    for name, http in _COMPARED:
        async with _served(http=http) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for url in URLS:
                writer.write(_request(url, b"{}"))
                answers.append(await _answer(reader))
            writer.write(_request("/v1/chat/completions", version="1.0"))
            answers.append(await _answer(reader))
            writer.close()
        seen[name] = answers
    assert seen["lean"] == seen["uvicorn"]
    assert seen["lean"][0]["path"] == "/v1/chat/completions"
    assert seen["lean"][-1]["http_version"] == "1.0"


async def test_a_busy_connection_outlives_the_keep_alive_time_and_an_idle_one_does_not() -> None:
    async with _served(timeout_keep_alive=0.4) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Requests 0.25 s apart for ~1 s: each idle stretch is shorter than
        # the keep-alive time, however the timer armed by the first falls.
        for _ in range(5):
            writer.write(_request("/x"))
            assert (await _answer(reader))["path"] == "/x"
            await asyncio.sleep(0.25)
        writer.write(_request("/y"))
        assert (await _answer(reader))["path"] == "/y"
        # Then idle past it: the server closes the connection.
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()


async def test_a_request_slower_than_the_keep_alive_time_is_not_cut() -> None:
    async with _served(timeout_keep_alive=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request("/x"))
        await _answer(reader)
        await asyncio.sleep(0.1)
        # A body sent over longer than the keep-alive time, after it went idle.
        writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await asyncio.sleep(0.6)
        writer.write(b"cd")
        answer = await _answer(reader)
        assert answer["path"] == "/slow" and answer["body"] == "abcd"
        writer.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with _served() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(_request(f"/n{i}", b"%d" % i) for i in range(4)))
        for i in range(4):
            answer = await _answer(reader)
            assert (answer["path"], answer["body"]) == (f"/n{i}", str(i))
        writer.close()


# Answers of every shape a head or body can take, and a few that uvicorn
# refuses: llmgw's protocol writes its usual heads itself (llmgw.http.answerhead).
_SHAPES: dict[str, tuple[int, Any, list[bytes]]] = {
    "/plain": (
        200,
        [(b"content-type", b"application/json"), (b"content-length", b"2"), (b"x", b"a")],
        [b"{}"],
    ),
    "/pieces": (201, [(b"content-length", b"6")], [b"ab", b"", b"cd", b"ef"]),
    "/stream": (
        200,
        [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        [b"data: 1\n\n", b"", b"data: 2\n\n"],
    ),
    "/bare": (200, [], [b"x"]),
    "/tuple": (404, ([b"content-length", b"1"],), [b"y"]),
    "/no-content": (204, [], [b""]),
    "/not-modified": (304, [(b"etag", b"1")], [b""]),
    "/upper": (200, [(b"X-Upper", b"A"), (b"Content-Length", b"1")], [b"z"]),
    "/two-lengths": (200, [(b"content-length", b"1"), (b"content-length", b"9")], [b"z"]),
    "/close": (200, [(b"connection", b"keep-alive, close"), (b"content-length", b"1")], [b"z"]),
    "/chunked": (200, [(b"transfer-encoding", b"chunked")], [b"abc"]),
    "/odd-status": (299, [(b"content-length", b"0")], [b""]),
    "/bad-value": (200, [(b"x-a", b"1\r\nx-b: 2"), (b"content-length", b"1")], [b"z"]),
    "/bad-name": (200, [(b"x a", b"1"), (b"content-length", b"1")], [b"z"]),
    "/bad-length": (200, [(b"content-length", b"one")], [b"z"]),
    "/short": (200, [(b"content-length", b"5")], [b"z"]),
    "/long": (200, [(b"content-length", b"1")], [b"zz"]),
}


async def _shapes(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()
    end = (200, [(b"content-length", b"3")], [b"end"])
    status, headers, parts = _SHAPES.get(scope["path"], end)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


async def test_each_answer_is_written_as_uvicorn_writes_it() -> None:
    requests = [
        (method, path, version)
        for path in _SHAPES
        for method, version in (("GET", "1.1"), ("HEAD", "1.1"), ("GET", "1.0"))
    ]
    written: dict[str, list[bytes]] = {}
    for name, http in _COMPARED:
        written[name] = []
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = server_config(Plain(_shapes), log_level="critical", loop="none", http=http)
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        task = await start_server(server, [sock])
        port = sock.getsockname()[1]
        try:
            for method, path, version in requests:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                # The answer, then a last one on the same connection that closes it.
                writer.write(
                    f"{method} {path} HTTP/{version}\r\nHost: x\r\n\r\n"
                    "GET /end HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
                )
                data = await asyncio.wait_for(reader.read(), 5)
                written[name].append(re.sub(rb"date: [^\r]*\r\n", b"date: -\r\n", data))
                writer.close()
        finally:
            server.should_exit = True
            await task
            sock.close()
    assert written["lean"] == written["uvicorn"]
    assert written["lean"][0].startswith(b"HTTP/1.1 200 OK\r\ndate: -\r\nserver: uvicorn\r\n")
