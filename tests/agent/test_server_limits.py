"""The agent's own server bounds slow heads, idle connections and connections at once (issue 13).

Real sockets on loopback: a client that dribbles a request head, or opens a
connection and says nothing, is cut off after the idle timeout (aiohttp's
default kept it an hour); past the connection limit a request gets 503; a
client that behaves is served meanwhile.
"""

from __future__ import annotations

import asyncio
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
