"""Servers for tests: ASGI apps on real loopback sockets, and `llmgw up` as a child process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from tests.waiting import eventually, eventually_sync

from llmgw.http.server import KEEP_ALIVE_S
from llmgw.servertls import ServerTls
from llmgw.serving import start_server


async def read_body(receive: Any) -> bytes:
    """The whole body of an ASGI request, however many messages it came in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def serve_asgi(
    app: Any, port: int | None = None, *, graceful_s: float | None = None,
    tls: ServerTls | None = None, http: Any = "auto",
) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 and yield its base URL.

    ``graceful_s`` bounds how long stopping waits for requests in flight (a
    gateway's long poll, say) before cutting them off; None waits for them.
    With ``tls``, it listens with that certificate and the URL is https://.
    ``http``: uvicorn's protocol setting (llmgw.http.connection's for a gateway).
    """
    # Bound here and handed to uvicorn: a port picked free and bound later may
    # be taken in between.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port or 0))
    # Keep-alive as llmgw's own servers keep it (llmgw.http.server): at
    # uvicorn's 5 s, equal to httpx's pool expiry, a loaded run saw the server
    # close an idle connection just as a test's client sent its next request
    # on it ("Server disconnected without sending a response").
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", access_log=False, loop="none", ws="none",
        timeout_graceful_shutdown=graceful_s, timeout_keep_alive=KEEP_ALIVE_S, http=http,
        **(tls.uvicorn_settings() if tls else {}),
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    try:
        task = await start_server(server, [sock])
        try:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            await task
    finally:
        sock.close()


# -- `llmgw up` as a child process ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
LLMGW = str(Path(sys.executable).with_name("llmgw"))


def up_json(data_dir: Path, exited: int | None, log: Path) -> dict[str, Any] | None:
    """What `llmgw up` (or `serve`) wrote to up.json, None before it has; fails at once if it
    exited."""
    if exited is not None:
        raise AssertionError(f"llmgw exited {exited} before up.json: {log.read_text()[-3000:]}")
    path = data_dir / "up.json"
    return dict(json.loads(path.read_text())) if path.exists() else None


async def stop_process(proc: asyncio.subprocess.Process, sig: int = signal.SIGINT) -> None:
    """Stop as a person does (Ctrl-C unless told); killed only if it hangs on the way out."""
    if proc.returncode is None:
        proc.send_signal(sig)
    try:
        async with asyncio.timeout(20):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()


@dataclass
class Up:
    info: dict[str, Any]  # up.json: URLs, tokens, keys
    data: Path
    port: int
    log: Path


@asynccontextmanager
async def llmgw_up(
    root: Path, *args: str, env: dict[str, str] | None = None,
    command: Sequence[str] = (LLMGW,), within_s: float = 40.0,
) -> AsyncIterator[Up]:
    """`llmgw up *args` on a free port and ``root``/data, once it has written up.json.

    Its output goes to ``root``/up.log; it is stopped with Ctrl-C on the way out.
    """
    data, log, port = root / "data", root / "up.log", free_port()
    with log.open("w") as out:
        proc = await asyncio.create_subprocess_exec(
            *command, "up", *args, "--data-dir", str(data), "--port", str(port),
            cwd=ROOT, stdout=out, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        try:
            info = await eventually(
                lambda: up_json(data, proc.returncode, log), within_s, what="up.json"
            )
            yield Up(info, data, port, log)
        finally:
            await stop_process(proc)


def spawn_up(
    data_dir: Path, port: int, log: Path, *args: str, env: dict[str, str] | None = None,
    append: bool = False,
) -> subprocess.Popen[bytes]:
    """`llmgw up *args` in its own session, its output written (or appended) to ``log``."""
    with log.open("ab" if append else "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw.cli.main", "up", "--data-dir", str(data_dir),
             "--port", str(port), *args, "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def wait_up_json(
    proc: subprocess.Popen[bytes], data_dir: Path, log: Path, within_s: float = 60.0
) -> dict[str, Any]:
    return eventually_sync(
        lambda: up_json(data_dir, proc.poll(), log), within_s, what="up.json", every_s=0.2
    )


def interrupt_up(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> bool:
    """Ctrl-C to a spawned `llmgw up`, its process alone (it stops what it started itself);
    False when it had not exited within ``grace_s`` and its whole session was killed."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return False
    return True


# -- other llmgw commands as child processes ----------------------------------------------


@asynccontextmanager
async def child_process(*argv: str, **options: Any) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process (``asyncio.create_subprocess_exec``), killed on the way out if it runs."""
    proc = await asyncio.create_subprocess_exec(*argv, **options)
    try:
        yield proc
    finally:
        await stop_process(proc, signal.SIGKILL)


async def terminates_cleanly(proc: asyncio.subprocess.Process, within_s: float = 15.0) -> None:
    """SIGTERM, as systemd stops it: it must exit 0, and soon."""
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), within_s) == 0


async def logged_port(
    proc: asyncio.subprocess.Process, pattern: str, within_s: float = 30.0
) -> int:
    """The port a process says on stderr it listens on (``pattern``'s one group)."""
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), within_s)).decode()
        assert line, f"exited before saying it listens: {pattern}"
        found = re.search(pattern, line)
        if found:
            return int(found.group(1))


def stop_group(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM,
               grace_s: float = 15.0) -> None:
    """Stop a process started in a session of its own (and what it started) with ``sig``;
    the whole group is killed if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
