"""A lean HTTP/1.1 keep-alive client for the hot path: one write out, httptools in.

Why not aiohttp here: measured on this project's machines, an aiohttp
request/response costs ~90 µs of CPU in the gateway process, against ~15 µs
for this client, and the gateway's whole budget is 500 µs at the median.
aiohttp builds a request object, a response object, a timer and several
header mappings per call; the gateway needs none of that: it sends one
pre-rendered POST and relays the answer's bytes. aiohttp remains the client
for everything off the hot path (the control-plane link).

What it does: per (host, port) a pool of idle connections
(:class:`~llmgw.http.upstream.UpstreamConnection`, which writes a request and
reads its :class:`~llmgw.http.upstream.Response`); a connection goes back to
the pool only after a complete answer on a keep-alive connection. A pooled
connection the engine closed while idle is retried once on a fresh one
before the failure counts against the replica (an idle-timeout close is not
a sick replica). Answers in progress are held to the pool's deadline.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Coroutine
from typing import Any

from llmgw.http.upstream import (
    MAX_ANSWER_BYTES,
    ConnectFailed,
    Key,
    Response,
    UpstreamConnection,
    UpstreamTimeout,
)

_MAX_IDLE_PER_HOST = 1024


class Pool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(
        self, connect_timeout_s: float, deadline_s: float,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self._connect_timeout = connect_timeout_s
        self._deadline = deadline_s
        self._idle: dict[Key, list[UpstreamConnection]] = {}
        self._closed = False
        # Answers in progress and when they must be done by. One sweep a second
        # enforces the deadline: a timer per request cost more than the check.
        self._active: dict[Response, float] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def _park(self, key: Key, conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= _MAX_IDLE_PER_HOST:
            conn.close()
        else:
            idle.append(conn)

    def _forget(self, key: Key, conn: UpstreamConnection) -> None:
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(
        self, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        key = (host, port, tls)
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, key, loop), host, port,
                    ssl=tls, server_hostname=host if tls is not None else None,
                )  # fmt: skip
        except TimeoutError:
            raise ConnectFailed(f"connect to {host}:{port} timed out") from None
        except ssl.SSLError as exc:
            # A certificate that does not verify is a broken upstream, not a
            # client's error: the request moves on, as from a refused connection.
            raise ConnectFailed(f"TLS with {host}:{port}: {exc.reason or exc}") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    def _checkout(self, key: Key) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.idle_ok():
                return conn
        return None

    async def warm(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> bool:
        """Open an idle connection to (host, port) ahead of its first request; True if one is idle.

        A first request otherwise pays the connection's setup on its way in
        (TCP, TLS's handshake where the engine speaks https, the engine's
        own per-connection start): about a millisecond on loopback, several
        with TLS. Nothing is counted against the replica when it fails: it
        may not listen yet, and a request will find out on its own. An
        engine that closes idle connections (vLLM's after 5 s) loses
        nothing either: a request finds the connection closed and opens
        another, as after any idle close.
        """
        key = (host, port, tls)
        if self._closed:
            return False
        if self._idle.get(key):
            return True
        try:
            conn = await self._connect(host, port, tls)
        except ConnectFailed:
            return False
        if self._closed or self._idle.get(key):
            conn.close()  # closed meanwhile, or a request parked one first
            return not self._closed
        conn.park()
        return True

    def request(
        self, host: str, port: int, payload: bytes, tls: ssl.SSLContext | None = None
    ) -> Coroutine[Any, Any, Response]:
        """Send ``payload`` (a whole HTTP/1.1 request) and wait for the answer's headers.

        ``tls``: https, verified by this context (made once by its owner:
        loading CAs costs milliseconds, too much per connection); None: plain.
        """
        key = (host, port, tls)
        return self._exchange(key, self._checkout(key), payload)

    async def _exchange(
        self, key: Key, conn: UpstreamConnection | None, payload: bytes
    ) -> Response:
        """``payload`` sent on ``conn`` (pooled) or a new connection; the answer once it begins.

        One coroutine for both tries: each level of coroutines a request
        waits in is resumed, frame by frame, at every wake-up.
        """
        pooled = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(*key)
            response = Response(conn)
            loop = conn.loop
            waiter = response._headers_waiter = loop.create_future()
            self._active[response] = loop.time() + self._deadline
            if self._sweeper is None:
                self._sweeper = loop.create_task(self._sweep())
            try:
                conn.send(payload, response)
                await waiter
            except ConnectFailed:
                response.release()
                if not pooled:
                    raise
                # An idle connection the engine had closed: once more, fresh.
                pooled = False
                conn = None
                continue
            except BaseException:
                response.release()
                raise
            finally:
                response._headers_waiter = None
            return response

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            now = loop.time()
            for response, deadline in list(self._active.items()):
                if deadline <= now:
                    _expire(response)

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _expire(response: Response) -> None:
    response._fail(UpstreamTimeout("the engine did not finish its answer in time"))
    conn = response._conn
    if conn is not None:
        conn.pool._active.pop(response, None)
        conn.close()


def request_head(
    host: str, port: int, path: str, engine_key: str | None = None, *, json: bool = True
) -> bytes:
    """The constant start of every POST to one engine path (rendered once per target).

    ``engine_key``: the replica's key, sent as a bearer token (wire.EngineKey
    admits only characters that are safe in a header, and an external
    model's key is checked the same way: gateway.external.upstream_key).
    ``json`` False: no Content-Type here; each request sends its own (a
    multipart form's boundary differs per request).
    """
    auth = f"Authorization: Bearer {engine_key}\r\n" if engine_key else ""
    kind = "Content-Type: application/json\r\n" if json else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}{kind}Content-Length: "
    ).encode("latin-1")


def render_post(head: bytes, body: bytes, extra: bytes) -> bytes:
    """A complete POST in one buffer (one write, one segment): ``extra`` is header lines."""
    return b"".join((head, str(len(body)).encode(), b"\r\n", extra, b"\r\n", body))
