"""A slow-connection attacker and a prober, on raw sockets in one event loop.

The attacker holds as many connections as it is told from one source
address, each sending one byte of a request head every few seconds and
never finishing it; a connection the server closes is opened again after
a short pause, as a real attacker keeps reopening them. The prober measures
how long a client on another address waits for a whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import resource
import socket
import time
from dataclasses import dataclass, field


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``wanted`` (to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


@dataclass
class Attack:
    source: str
    host: str
    port: int
    connections: int
    every_s: float = 3.0  # a byte per connection about this often
    reopen_after_s: float = 0.5
    opened: int = 0  # connections the server accepted, all told
    open_now: int = 0  # connections open at this moment, as the attacker sees them
    closed_by_server: int = 0
    failed_connects: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Set once every connection was opened at least once.
    all_opened: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._hold(i)) for i in range(self.connections)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _hold(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        # Spread over the first seconds: the listen backlog takes ~4 k at once.
        await asyncio.sleep(index * 0.0008)
        head = b"POST /agent/v1/report HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.bind((self.source, 0))
                async with asyncio.timeout(5):
                    await loop.sock_connect(sock, (self.host, self.port))
            except (OSError, TimeoutError):
                sock.close()
                self.failed_connects += 1
                await asyncio.sleep(self.reopen_after_s)
                continue
            self.opened += 1
            self.open_now += 1
            if self.opened >= self.connections:
                self.all_opened.set()
            try:
                at = 0
                while True:
                    sock.send(head[at:at + 1])
                    at = (at + 1) % len(head)
                    try:
                        async with asyncio.timeout(self.every_s * random.uniform(0.5, 1.5)):
                            await loop.sock_recv(sock, 4096)
                        break  # an answer (503) or the server's close
                    except TimeoutError:
                        continue
            except OSError:
                pass
            finally:
                self.open_now -= 1
                sock.close()
            self.closed_by_server += 1
            await asyncio.sleep(self.reopen_after_s)


async def timed_get(host: str, port: int, path: str, token: str | None = None,
                    timeout_s: float = 5.0) -> tuple[float, int]:
    """(seconds, status) of one GET on a fresh connection, read to the answer's end."""
    headers = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    if token:
        headers += f"Authorization: Bearer {token}\r\n"
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write((headers + "\r\n").encode())
                answer = await reader.read()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError):
        return time.perf_counter() - started, 0
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return time.perf_counter() - started, status


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def probe(
    host: str, port: int, token: str, seconds: float
) -> dict[str, list[float] | list[int]]:
    """/healthz and an admin call, in turn, for ``seconds``: their latencies and statuses."""
    health: list[float] = []
    admin: list[float] = []
    statuses: list[int] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        took, status = await timed_get(host, port, "/healthz")
        health.append(took)
        statuses.append(status)
        took, status = await timed_get(host, port, "/admin/v1/nodes", token)
        admin.append(took)
        statuses.append(status)
        await asyncio.sleep(0.05)
    return {"healthz": health, "admin": admin, "statuses": statuses}


if __name__ == "__main__":
    # The prober as a process of its own: the attacker's loop must not delay its measurements.
    import json
    import sys

    host, port, token, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    print(json.dumps(asyncio.run(probe(host, port, token, seconds))))


async def assert_slow_heads_cut_off(port: int, path: str) -> None:
    """A server whose head deadline is about half a second closes a connection whose head
    comes a header every 0.2 s, answering nothing, well before the head ends; and one that
    never sends a byte too."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        with contextlib.suppress(ConnectionResetError):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode())
            for _ in range(10):
                await asyncio.sleep(0.2)
                if reader.at_eof():
                    break
                writer.write(b"X-Slow: 1\r\n")
            assert await asyncio.wait_for(reader.read(), 3.0) == b""
    finally:
        writer.close()
    assert time.monotonic() - started < 2.5
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await asyncio.wait_for(reader.read(), 3.0) == b""
    writer.close()
