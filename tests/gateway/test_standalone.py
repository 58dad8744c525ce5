"""`llmgw gateway` as its own process, following a control plane."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from typing import Any

from tests.gateway.conftest import async_client, make_config, route
from tests.gateway.fake_control_plane import TOKEN, FakeControlPlane


async def _start(control_plane: str, token: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw.cli.main", "gateway",
        "--control-plane", control_plane, "--token", token,
        "--host", "127.0.0.1", "--port", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def test_standalone_gateway_serves_and_stops_cleanly(upstreams: Any) -> None:
    engine = await upstreams("e1")
    plane = await FakeControlPlane(make_config(1, [route("m", [engine])])).start()
    process = await _start(plane.url, TOKEN)
    try:
        assert process.stderr is not None
        port = None
        while port is None:
            line = (await asyncio.wait_for(process.stderr.readline(), 30)).decode()
            assert line, "gateway exited before listening"
            found = re.search(r"gateway listening on 127\.0\.0\.1:(\d+)", line)
            port = int(found.group(1)) if found else None
        client = async_client(f"http://127.0.0.1:{port}")
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message.content == "hello from e1"
        for _ in range(100):
            if plane.usage:
                break
            await asyncio.sleep(0.1)
        assert plane.usage[0].requests == 1
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await plane.stop()


async def test_refused_token_is_a_one_line_configuration_error() -> None:
    plane = await FakeControlPlane(make_config(1, [])).start()
    try:
        process = await _start(plane.url, "llmgw-gw-wrong")
        assert process.stderr is not None
        output = (await asyncio.wait_for(process.stderr.read(), 30)).decode()
        assert await process.wait() == 2
        assert output.strip().splitlines()[-1].startswith("llmgw: ")
        assert "refused the gateway token" in output
        assert "Traceback" not in output
    finally:
        await plane.stop()
