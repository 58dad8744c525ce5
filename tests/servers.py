"""Running ASGI apps on real loopback sockets inside tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from llmgw.tls import ServerTls


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def serve_asgi(
    app: Any, port: int | None = None, *, graceful_s: float | None = None,
    tls: ServerTls | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 and yield its base URL.

    ``graceful_s`` bounds how long stopping waits for requests in flight (a
    gateway's long poll, say) before cutting them off; None waits for them.
    With ``tls``, it listens with that certificate and the URL is https://.
    """
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port or free_port(), lifespan="off", log_level="warning",
        access_log=False, loop="none", timeout_graceful_shutdown=graceful_s,
        **(tls.uvicorn_settings() if tls is not None else {}),
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        await task
