"""No unauthenticated caller holds a server (issue 29, item 3): each rule on its own.

Credentials before bodies, deadlines for a whole body, connections closed
after a refusal, and a cap on connections per client address. The test with
6,000 slow connections is tests/test_slow_clients.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.control.planekit import opened_plane
from tests.control.test_request_limits import _served

from llmgw.addresscap import AddressCounts, address_key
from llmgw.control.app import create_app
from llmgw.control.limits import BodyLimit
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.http.connection import LeanHttpProtocol
from llmgw.http.server import Plain


@pytest.fixture
async def control(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, NewCredentials, int]]:
    async with opened_plane(tmp_path) as (cp, creds), _served(create_app(cp)) as port:
        yield cp, creds, port


async def _read_all(reader: asyncio.StreamReader, within_s: float = 3.0) -> bytes:
    """What the server sends until it closes (a reset after its answer counts as a close)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        async with asyncio.timeout(within_s):
            while piece := await reader.read(65536):
                data += piece
    return data


async def _refused_at_once(port: int, request: bytes) -> bytes:
    """Send ``request``: the server's whole answer, a 401 closing the connection within 2 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    started = time.monotonic()
    answer = await _read_all(reader)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - started < 2.0
    return answer


async def test_a_report_without_a_node_token_is_refused_before_its_body_arrives(
    control: tuple[ControlPlane, NewCredentials, int],
) -> None:
    _, _, port = control
    # 1 MB declared, 10 bytes sent: the answer must not wait for the rest.
    answer = await _refused_at_once(port, (
        b"POST /agent/v1/report HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n{\"node\": \""))
    assert b"connection: close" in answer.lower()


async def test_a_refused_caller_s_connection_is_closed(
    control: tuple[ControlPlane, NewCredentials, int],
) -> None:
    _, _, port = control
    for head in (b"GET /admin/v1/nodes HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET /admin/v1/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n",
                 b"POST /agent/v1/register HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: 99999999\r\n\r\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        started = time.monotonic()
        answer = await _read_all(reader)  # ends: the server closed the connection
        writer.close()
        assert answer.split(b" ")[1] in (b"401", b"413"), answer[:200]
        assert time.monotonic() - started < 2.0, "the connection was kept open after a refusal"


async def test_a_body_trickled_within_each_idle_limit_is_cut_off_at_the_whole_body_deadline(
    control: tuple[ControlPlane, NewCredentials, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(LeanHttpProtocol, "body_timeout_s", 1.0)
    _, creds, port = control
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # With its join token: a registration without one is refused before its body.
    writer.write(b"POST /agent/v1/register HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                 + f"Authorization: Bearer {creds.join_token}\r\n\r\n{{".encode())
    started = time.monotonic()
    answer_read = asyncio.create_task(_read_all(reader, 5.0))
    for _ in range(30):  # a byte every 0.1 s: well inside the 30 s idle limit
        await asyncio.sleep(0.1)
        if answer_read.done() or writer.is_closing():
            break
        try:
            writer.write(b" ")
        except ConnectionError:
            break
    answer = await answer_read
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 0.9 < time.monotonic() - started < 2.5


async def test_body_limit_has_a_deadline_for_the_whole_body_under_any_server() -> None:
    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        while (await receive())["more_body"]:  # type: ignore[operator]
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        await asyncio.sleep(0.05)  # each piece well inside the idle limit
        return {"type": "http.request", "body": b"x", "more_body": True}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    limited = BodyLimit(app, idle_s=10.0, total_s=0.5)  # type: ignore[arg-type]
    started = time.monotonic()
    await limited({"type": "http", "path": "/agent/v1/register", "headers": []}, receive, send)
    assert sent[0]["status"] == 408
    assert b"not complete within 0.5 s" in sent[1]["body"]  # type: ignore[operator]
    assert time.monotonic() - started < 1.5


async def test_one_address_cannot_take_every_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LeanHttpProtocol, "max_per_address", 3)

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    async def connect(source: str) -> socket.socket:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return sock

    async def get(source: str) -> bytes:
        sock = await connect(source)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            async with asyncio.timeout(3):
                while piece := await loop.sock_recv(sock, 65536):
                    data += piece
            return data
        finally:
            sock.close()

    async def refused(source: str) -> bytes:
        # Nothing sent: the refusal is written at once, before any byte is read.
        sock = await connect(source)
        try:
            async with asyncio.timeout(3):
                return await asyncio.get_running_loop().sock_recv(sock, 65536)
        finally:
            sock.close()

    async with _served(Plain(app)) as port:
        held = [await connect("127.0.0.2") for _ in range(3)]
        await asyncio.sleep(0.1)
        # The fourth from the same address is refused before anything is read...
        assert (await refused("127.0.0.2")).startswith(b"HTTP/1.1 503")
        # ...while another address is served, and the first again once one closes.
        assert (await get("127.0.0.1")).startswith(b"HTTP/1.1 200")
        held.pop().close()
        await asyncio.sleep(0.1)
        assert (await get("127.0.0.2")).startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()


def test_clients_are_counted_by_address_and_ipv6_clients_by_their_64() -> None:
    assert address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:ffff::9")
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("::1") == "::1"
    counts = AddressCounts(2)
    keys = [counts.take("10.0.0.1"), counts.take("10.0.0.1")]
    assert counts.take("10.0.0.1") is None and counts.take("10.0.0.2") == "10.0.0.2"
    for key in keys:
        assert key is not None
        counts.give(key)
    assert "10.0.0.1" not in counts.counts
    assert AddressCounts(0).take("10.0.0.1") == "10.0.0.1"  # 0: no cap


async def test_the_gateway_closes_the_connection_after_a_401() -> None:
    # It kept the connection for its whole keep-alive time (75 s in a bench).
    from tests.gateway.conftest import make_config, running_gateway

    from llmgw.gateway.link import MemoryLink

    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, []))
    async with running_gateway(link) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        await _refused_at_once(port, (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer sk-wrong\r\nContent-Length: 2\r\n\r\n{}"))
