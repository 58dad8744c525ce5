"""The uvicorn settings every llmgw server uses (serve, up, a standalone gateway).

uvicorn on its own bounds neither how long a client may take to send a
request's head nor how large the head may be: its keep-alive timer is armed
only after an answer and cancelled by any byte, and httptools accepts headers
of any size. One client could hold a connection with a byte every minute, or
send a head of gigabytes. :class:`GuardedHttpToolsProtocol` closes a
connection whose request head is not complete within ``HEAD_TIMEOUT_S`` of
its first byte (or of the connection opening), and refuses a head over
``MAX_HEAD_BYTES``; ``limit_concurrency`` answers 503 past a number of
connections instead of running out of file descriptors; idle keep-alive
connections close after ``KEEP_ALIVE_S``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TIMEOUT_S = 10.0
# Large enough for any OpenAI client's headers (a long bearer token, tracing
# headers), small enough that a head never matters for memory.
MAX_HEAD_BYTES = 64 * 1024
# Longer than uvicorn's 5 s: OpenAI clients keep pooled connections for a
# while, and a close racing their next request is an error they must retry.
KEEP_ALIVE_S = 30
# Connections (and requests) at once, past which new ones get 503. Streaming
# answers hold a connection each; 4,096 is well above what one gateway
# process serves and below the usual 65,536 descriptors.
MAX_CONNECTIONS = 4096


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on request heads."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            # Raised inside httptools' callback: uvicorn answers 400 and closes.
            raise ValueError(f"request head over {self.max_head_bytes} bytes")

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # Only a connection waiting for a head: an answer in progress (a long
        # stream) is never cut by this timer.
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.transport.close()


def server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config with llmgw's limits; ``kwargs`` add to or override them."""
    settings: dict[str, Any] = {
        "http": GuardedHttpToolsProtocol,
        "ws": "none",
        "lifespan": "off",
        "access_log": False,
        # Client addresses are not used; the middleware costs per request.
        "proxy_headers": False,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "limit_concurrency": MAX_CONNECTIONS,
        **kwargs,
    }
    return uvicorn.Config(app, **settings)
