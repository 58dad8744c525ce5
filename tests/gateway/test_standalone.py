"""`llmgw gateway` as its own process, following a control plane."""

from __future__ import annotations

import asyncio
from asyncio.subprocess import Process
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
from tests.gateway.conftest import (
    GATEWAY_COMMAND,
    GATEWAY_LISTENING,
    async_client,
    make_config,
    route,
)
from tests.gateway.fake_control_plane import TOKEN, FakeControlPlane
from tests.servers import child_process, logged_port, terminates_cleanly
from tests.waiting import eventually


def _start(
    control_plane: str, token: str, *flags: str
) -> AbstractAsyncContextManager[Process]:
    return child_process(
        *GATEWAY_COMMAND, "--control-plane", control_plane, "--token", token,
        "--host", "127.0.0.1", "--port", "0", *flags, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def test_standalone_gateway_serves_and_stops_cleanly(upstreams: Any) -> None:
    engine = await upstreams("e1")
    plane = await FakeControlPlane(make_config(1, [route("m", [engine])])).start()
    try:
        async with _start(plane.url, TOKEN) as process:
            port = await logged_port(process, GATEWAY_LISTENING)
            client = async_client(f"http://127.0.0.1:{port}")
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            assert answer.choices[0].message.content == "hello from e1"
            await eventually(lambda: plane.usage, what="the usage report")
            assert plane.usage[0].requests == 1
            await terminates_cleanly(process)
    finally:
        await plane.stop()


async def test_refused_token_is_a_one_line_configuration_error() -> None:
    plane = await FakeControlPlane(make_config(1, [])).start()
    try:
        async with _start(plane.url, "llmgw-gw-wrong") as process:
            assert process.stderr is not None
            output = (await asyncio.wait_for(process.stderr.read(), 30)).decode()
            assert await process.wait() == 2
        assert output.strip().splitlines()[-1].startswith("llmgw: ")
        assert "refused the gateway token" in output
        assert "Traceback" not in output
    finally:
        await plane.stop()


async def test_metrics_are_closed_unless_a_token_is_set_or_they_are_opened() -> None:
    # A standalone gateway faces clients on a shared network: its metrics
    # name every model and show the traffic.
    plane = await FakeControlPlane(make_config(1, [])).start()
    try:
        async with _start(plane.url, TOKEN) as process:
            port = await logged_port(process, GATEWAY_LISTENING)
            async with httpx.AsyncClient() as client:
                closed = await client.get(f"http://127.0.0.1:{port}/metrics")
                assert closed.status_code == 401 and "--open-metrics" in closed.text
                with_key = await client.get(f"http://127.0.0.1:{port}/metrics",
                                            headers={"Authorization": f"Bearer {TOKEN}"})
                assert with_key.status_code == 401  # the gateway token is not a scrape token
            await terminates_cleanly(process)
        async with _start(plane.url, TOKEN, "--open-metrics") as process:
            port = await logged_port(process, GATEWAY_LISTENING)
            async with httpx.AsyncClient() as client:
                opened = await client.get(f"http://127.0.0.1:{port}/metrics")
                assert opened.status_code == 200 and "llmgw_gateway" in opened.text
            await terminates_cleanly(process)
    finally:
        await plane.stop()
