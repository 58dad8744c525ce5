"""The agent's own server bounds slow heads, idle connections and connections at once (issue 13).

Real sockets on loopback: a client that dribbles a request head, or opens a
connection and says nothing, is cut off after the idle timeout (aiohttp's
default kept it an hour); past the connection limit a request gets 503; a
client that behaves is served meanwhile.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tests.waiting import eventually

from llmgw.agent.server import IDLE_TIMEOUT_S, WeightsServer
from llmgw.agent.weights import WeightsCache


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[WeightsServer]:
    served = WeightsServer(WeightsCache(tmp_path / "weights"), lambda: "peer",
                           idle_timeout_s=0.5, max_connections=3)
    await served.start()
    yield served
    await served.stop()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        while await reader.read(4096):
            pass
    return time.monotonic() - started


async def test_a_slow_head_and_a_silent_connection_are_cut(server: WeightsServer) -> None:
    assert IDLE_TIMEOUT_S <= 30  # the default bounds them too, not aiohttp's hour
    silent = await asyncio.open_connection("127.0.0.1", server.port)
    slow = await asyncio.open_connection("127.0.0.1", server.port)
    slow[1].write(b"GET /agent/v1/health HTTP/1.1\r\n")

    async def dribble() -> None:
        for _ in range(40):  # a header byte every 0.1 s: never a whole head
            await asyncio.sleep(0.1)
            if slow[1].is_closing():
                return
            slow[1].write(b"X")

    task = asyncio.create_task(dribble())
    # Cut within the timeout (0.5 s) plus a generous margin for a loaded machine,
    # while dribbling would go on for 4 s.
    assert await _closed_within(silent[0], 3.5) < 3.5
    assert await _closed_within(slow[0], 3.5) < 3.5
    task.cancel()
    for _, writer in (silent, slow):
        writer.close()
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{server.port}/agent/v1/health") as answer:
        assert answer.status == 200


async def test_past_the_connection_limit_requests_get_503(server: WeightsServer) -> None:
    held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{server.port}/agent/v1/health") as answer:
            assert answer.status == 503 and answer.headers["Retry-After"] == "1"
    finally:
        for _, writer in held:
            writer.close()

    async def served() -> bool:
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{server.port}/agent/v1/health") as answer:
            return answer.status == 200

    await eventually(served, 5, what="health served once the connections closed")


async def test_one_address_cannot_take_every_connection(tmp_path: Path) -> None:
    served = WeightsServer(WeightsCache(tmp_path / "weights"), lambda: "peer",
                           max_per_address=2)
    await served.start()
    loop = asyncio.get_running_loop()

    async def connect(source: str) -> socket.socket:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", served.port))
        return sock

    try:
        held = [await connect("127.0.0.2") for _ in range(2)]
        refused = await connect("127.0.0.2")
        async with asyncio.timeout(3):
            answer = await loop.sock_recv(refused, 4096)
        refused.close()
        # Refused before a byte was read; another address is still served.
        assert answer.startswith(b"HTTP/1.1 503"), answer
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{served.port}/agent/v1/health") as health:
            assert health.status == 200
        for sock in held:
            sock.close()
    finally:
        await served.stop()


async def test_a_caller_without_the_peer_token_is_refused_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    served = WeightsServer(WeightsCache(tmp_path / "weights"), lambda: "peer")
    await served.start()  # the default idle timeout (10 s), longer than this test waits
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET /agent/v1/weights/manifest?model=m HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        async with asyncio.timeout(3):  # ends with the server's close
            while piece := await reader.read(4096):
                data += piece
        writer.close()
        assert data.startswith(b"HTTP/1.1 401"), data[:200]
    finally:
        await served.stop()
