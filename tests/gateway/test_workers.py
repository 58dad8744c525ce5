"""`llmgw gateway --workers 2`: two processes on one port, supervised (llmgw.cli.workers).

Real processes and the official client throughout: the parent binds the
port and starts its workers, each a standalone gateway following the
(fake) control plane. Each request below is a client of its own, so a
connection of its own, which the kernel hands to either worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from asyncio.subprocess import Process
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import openai
import psutil
from tests.gateway.conftest import (
    GATEWAY_COMMAND,
    SECRET,
    api_key,
    async_client,
    make_config,
    route,
)
from tests.gateway.fake_control_plane import TOKEN, FakeControlPlane
from tests.servers import child_process
from tests.waiting import eventually

WORKER_LISTENING = re.compile(
    r"gateway listening on 127\.0\.0\.1:(\d+).*\(worker (\d+) of (\d+), pid (\d+)\)")


def _start(control_plane: str, *flags: str) -> AbstractAsyncContextManager[Process]:
    return child_process(
        *GATEWAY_COMMAND, "--control-plane", control_plane, "--token", TOKEN,
        "--host", "127.0.0.1", "--port", "0", "--workers", "2", *flags,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


class Workers:
    """The workers a parent's log says are listening: index -> pid, and the port."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.pids: dict[int, int] = {}
        self.port = 0
        self.log: list[str] = []

    async def until(self, ready: Any, within_s: float = 60.0) -> None:
        assert self.process.stderr is not None
        async with asyncio.timeout(within_s):
            while not ready(self):
                line = (await self.process.stderr.readline()).decode()
                assert line, f"the gateway exited: {''.join(self.log[-20:])}"
                self.log.append(line)
                found = WORKER_LISTENING.search(line)
                if found:
                    self.port = int(found.group(1))
                    self.pids[int(found.group(2))] = int(found.group(4))

    def drain(self) -> None:
        """Keep reading the log (a full pipe would block the processes writing it)."""
        async def read() -> None:
            with contextlib.suppress(AssertionError):  # the processes ended
                await self.until(lambda _: False, 3600)

        self._drain = asyncio.get_running_loop().create_task(read())


async def _chats(port: int, count: int, key: str = SECRET) -> list[int]:
    """``count`` chats at once, each on a connection of its own: their HTTP statuses."""

    async def one() -> int:
        client = async_client(f"http://127.0.0.1:{port}", key=key)
        try:
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            return exc.status_code
        assert answer.choices[0].message.content == "hello from e1"
        return 200

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def test_two_workers_serve_one_port_survive_a_kill_and_stop_together(
    upstreams: Any,
) -> None:
    engine = await upstreams("e1")
    plane = await FakeControlPlane(make_config(1, [route("m", [engine])])).start()
    try:
        async with _start(plane.url, "--open-metrics") as parent:
            workers = Workers(parent)
            await workers.until(lambda w: len(w.pids) == 2)
            workers.drain()
            port = workers.port
            assert await _chats(port, 20) == [200] * 20
            client = async_client(f"http://127.0.0.1:{port}")
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
            assert text.strip()
            # Both workers served (each reports its own requests under its
            # own gateway id), and each request's usage reached the
            # control plane once.
            await eventually(lambda: sum(u.requests for u in plane.usage) >= 21,
                             within_s=15, what="the usage reports")
            await asyncio.sleep(2.5)  # a late (double) report would come by now
            assert sum(u.requests for u in plane.usage) == 21
            served = {load.gateway_id for load in plane.loads
                      if any(r.requests for r in load.replicas)}
            assert len(served) == 2, served
            async with httpx.AsyncClient() as http:
                metrics = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert re.search(r'llmgw_gateway_worker\{worker="[01]",workers="2"\} 1', metrics.text)

            # A killed worker is replaced; meanwhile the port keeps answering.
            victim = workers.pids[0]
            os.kill(victim, signal.SIGKILL)
            # Once the parent saw it die, new connections go to the live one
            # (before, one may land in the dead one's backlog and be reset,
            # which the client retries: max_retries=0 here).
            await eventually(lambda: any("worker 0 exited" in line for line in workers.log),
                             within_s=10, what="the parent to see worker 0 die")
            assert await _chats(port, 10) == [200] * 10
            await workers.until(lambda w: w.pids[0] != victim, within_s=30)
            assert psutil.pid_exists(workers.pids[0]) and psutil.pid_exists(workers.pids[1])
            assert await _chats(port, 10) == [200] * 10

            # SIGTERM stops the parent and every worker.
            parent.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(parent.wait(), 20) == 0
            assert not any(psutil.pid_exists(pid) for pid in workers.pids.values())
    finally:
        await plane.stop()


async def test_a_keys_rpm_holds_across_workers_and_workers_die_with_their_parent(
    upstreams: Any,
) -> None:
    engine = await upstreams("e1")
    rpm = 6
    config = make_config(1, [route("m", [engine])], keys=[api_key(rpm=rpm)])
    plane = await FakeControlPlane(config).start()
    try:
        async with _start(plane.url) as parent:
            workers = Workers(parent)
            await workers.until(lambda w: len(w.pids) == 2)
            workers.drain()
            statuses = await _chats(workers.port, 30)
            served = statuses.count(200)
            # Each worker admits 1/2 of the key's limit: together at most
            # the limit (not 2x), and more than one worker's share.
            assert rpm // 2 < served <= rpm, statuses
            assert set(statuses) == {200, 429}

            # A parent killed without a chance to stop its workers: they
            # see their lifeline close and stop on their own.
            parent.kill()
            await parent.wait()
            await eventually(lambda: not any(psutil.pid_exists(p) for p in workers.pids.values()),
                             within_s=20, what="the workers to stop with their parent")
    finally:
        await plane.stop()
