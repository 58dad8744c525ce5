"""A lean HTTP/1.1 keep-alive client for the hot path: one write out, httptools in.

Why not aiohttp here: measured on this project's machines, an aiohttp
request/response costs ~90 µs of CPU in the gateway process, against ~15 µs
for this client, and the gateway's whole budget is 500 µs at the median.
aiohttp builds a request object, a response object, a timer and several
header mappings per call; the gateway needs none of that: it sends one
pre-rendered POST and relays the answer's bytes. aiohttp remains the client
for everything off the hot path (the control-plane link).

What it does: per (host, port) a pool of idle connections; a request is
written with a single ``transport.write``; the answer is parsed by httptools
(status, headers, body de-chunked) and its body handed over chunk by chunk;
a connection goes back to the pool only after a complete answer on a
keep-alive connection. A pooled connection the engine closed while idle is
retried once on a fresh one before the failure counts against the replica
(an idle-timeout close is not a sick replica).

Failure classes, as the gateway needs them:
* :class:`ConnectFailed`: refused, reset or closed before any byte of the
  answer arrived; the request may be retried on another replica.
* :class:`BodyBroken`: the connection broke after the answer began.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, cast

import httptools

_HIGH_WATER = 1 << 20  # buffered answer bytes before a streamed answer stops being read
# The largest answer read whole (non-streamed). Embeddings of a large batch
# run to tens of MB; anything far past that is an engine gone wrong, and
# buffering it would let one answer take the gateway's memory.
MAX_ANSWER_BYTES = 256 << 20
_MAX_IDLE_PER_HOST = 1024
# An answer's head past this is no engine's: refused as a broken answer.
# Without a cap, an upstream sending header lines without end (an external
# model's host, a hostile engine) grew the gateway's memory until the
# request's deadline (found by bench/fuzz.py).
MAX_HEAD_BYTES = 256 << 10

# Connections are pooled per (host, port, TLS context): an https upstream
# never shares a pool with a plain engine, nor one verified against the
# fleet's CA (an engine llmgw runs) with one verified against the system's
# CAs (an external model's hosted API).
_Key = tuple[str, int, ssl.SSLContext | None]


class ConnectFailed(Exception):
    """No byte of the answer arrived: the request can be sent elsewhere."""


class BodyBroken(Exception):
    """The answer started, then the connection broke or the answer was malformed."""


class AnswerTooLarge(BodyBroken):
    """A non-streamed answer grew past the pool's ``max_answer_bytes``."""


class UpstreamTimeout(Exception):
    """The answer did not complete within the request's deadline."""


class Response:
    """One answer: status and headers once known, then body chunks as they arrive."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_error",
        "_headers_waiter",
        "_size",
        "_waiter",
        "_whole",
        "complete",
        "content_type",
        "started",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = 0
        self.content_type: bytes | None = None
        self.started = False  # any byte of the answer arrived
        self.complete = False
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._headers_waiter: asyncio.Future[None] | None = None
        # read() wants the whole answer: the high-water mark (flow control
        # for a relay that forwards chunks) no longer applies, the size cap does.
        self._whole = False

    # -- fed by the connection ---------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headers_done(self) -> None:
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._whole:
            self._check_size()
        elif self._size > _HIGH_WATER and self._conn is not None:
            self._conn.pause()
        # _wake, inline: called per HTTP chunk (an SSE event each from most
        # engines), where only the first of a burst finds a waiter.
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_size(self) -> None:
        conn = self._conn
        limit = conn.pool.max_answer_bytes if conn is not None else MAX_ANSWER_BYTES
        if self._size > limit and not self.complete:
            self._fail(AnswerTooLarge(f"the answer is over {limit} bytes"))
            if conn is not None:
                conn.close()

    def _finish(self) -> None:
        self.complete = True
        self._headers_done()
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.complete:
            return
        self._error = error
        for waiter in (self._headers_waiter, self._waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)

    # -- used by the gateway -----------------------------------------------------

    def _new_waiter(self) -> asyncio.Future[None]:
        """What the caller awaits (and then forgets) for the answer's next bytes.

        Awaited in the caller's own frame, not in a coroutine of its own: a
        coroutine more would be resumed, frame by frame, at every wake-up.
        """
        conn = self._conn
        # The connection's loop: asyncio.get_running_loop() is a getpid()
        # system call each time on Python 3.11.
        loop = conn.loop if conn is not None else asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        return waiter

    async def read(self) -> bytes:
        """The whole body (raises BodyBroken, AnswerTooLarge or UpstreamTimeout)."""
        # Before this, an answer over the high-water mark paused the socket
        # and nothing resumed it: the request hung until the upstream deadline.
        self._whole = True
        self._check_size()
        if self._conn is not None:
            self._conn.resume()
        while not self.complete:
            if self._error is not None:
                raise self._error
            try:
                await self._new_waiter()
            finally:
                self._waiter = None
        data = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        self._size = 0
        return data

    async def next_chunk(self) -> bytes | None:
        """All of the body that has arrived and was not taken yet, or None at its end.

        All of it, not one piece: httptools hands over a chunked answer one
        HTTP chunk at a time (one SSE event each, from most engines), and a
        relay writes to its client once per piece it gets, so several events
        that arrived together cost one write instead of one each.
        """
        while not self._chunks:
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            try:
                await self._new_waiter()
            finally:
                self._waiter = None
        chunks = self._chunks
        if len(chunks) == 1:
            chunk = chunks.popleft()
        else:
            chunk = b"".join(chunks)
            chunks.clear()
        self._size -= len(chunk)
        if self._conn is not None and self._size < _HIGH_WATER // 2:
            self._conn.resume()
        return chunk

    @property
    def drained(self) -> bool:
        """The answer is complete and every chunk of it was taken: next_chunk() is None."""
        return self.complete and not self._chunks

    def release(self) -> None:
        """Give the connection back (complete answer) or close it (anything else).

        Closing an unfinished answer is how an engine learns the client left:
        it sees the connection drop and stops generating.
        """
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.pool._active.pop(self, None)
        if self.complete and conn.reusable():
            conn.park()
        else:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine."""

    def __init__(self, pool: Pool, key: _Key, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self._key = key
        self.loop = loop
        # Body pieces of the bytes being parsed, handed to the answer as one
        # when the parser is done with them (_hand_over). httptools calls
        # on_body once per HTTP chunk (an SSE event each from most engines,
        # several per read): the list's own append, with no Python frame.
        # Set before the parser, which looks its callbacks up once.
        self._pieces: list[bytes] = []
        self.on_body: Callable[[bytes], None] = self._pieces.append
        # The answer's headers as the engine names them, likewise without a
        # Python frame per header (an engine sends four to ten, the gateway
        # reads one); emptied for each request.
        self._headers: dict[bytes, bytes] = {}
        self.on_header: Callable[[bytes, bytes], None] = self._headers.__setitem__
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: Response | None = None
        self._keep_alive = False
        self._paused = False
        self.closed = False
        self.used = False  # served at least one answer (may be stale when reused)
        # Bytes read since the request was sent, while its answer's head is
        # not complete (None: the head is complete).
        self._head_bytes: int | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, don't check.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            # Bytes nobody asked for: the connection cannot be trusted any more.
            self.close()
            return
        response.started = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._hand_over()
            response._fail(BodyBroken(f"malformed answer: {exc}"))
            self.close()
            return
        if self._head_bytes is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                response._fail(BodyBroken(f"the answer's head is over {MAX_HEAD_BYTES} bytes"))
                self.close()
                return
        if self._pieces:
            self._hand_over()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self._key, self)
        response = self._response
        if response is not None and not response.complete:
            if response.started:
                response._fail(BodyBroken(f"connection lost mid-answer: {exc or 'closed'}"))
            else:
                response._fail(ConnectFailed(f"connection closed before an answer: {exc or 'EOF'}"))

    # httptools callbacks (on_header and on_body: see __init__)
    def on_headers_complete(self) -> None:
        self._head_bytes = None
        response = self._response
        if response is not None:
            headers = self._headers
            kind = headers.get(b"content-type") or headers.get(b"Content-Type")
            if kind is None and headers:
                kind = _content_type(headers)
            response.content_type = kind
            response.status = self._parser.get_status_code()
            self._keep_alive = self._parser.should_keep_alive()
            response._headers_done()

    def _hand_over(self) -> None:
        pieces = self._pieces
        response = self._response
        if response is not None and pieces:
            response._body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        pieces.clear()

    def on_message_complete(self) -> None:
        response = self._response
        pieces = self._pieces
        if pieces:
            # _hand_over, inline: an unstreamed answer's one piece ends here.
            if response is not None:
                response._body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
                response = self._response  # None if _body closed the connection (size cap)
            pieces.clear()
        if response is not None:
            response._finish()

    # used by Pool / Response
    def send(self, payload: bytes, response: Response) -> None:
        self._response = response
        self._headers.clear()
        self._head_bytes = 0
        self.used = True
        assert self._transport is not None
        self._transport.write(payload)

    def reusable(self) -> bool:
        return self._keep_alive and not self.closed and not self._paused

    def park(self) -> None:
        self._response = None
        self.pool._park(self._key, self)

    def pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        self._response = None
        if not self.closed and self._transport is not None:
            self.closed = True
            self._transport.abort()

    def idle_ok(self) -> bool:
        transport = self._transport
        return not self.closed and transport is not None and not transport.is_closing()


class Pool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(
        self, connect_timeout_s: float, deadline_s: float,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self._connect_timeout = connect_timeout_s
        self._deadline = deadline_s
        self._idle: dict[_Key, list[_Connection]] = {}
        self._closed = False
        # Answers in progress and when they must be done by. One sweep a second
        # enforces the deadline: a timer per request cost more than the check.
        self._active: dict[Response, float] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def _park(self, key: _Key, conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= _MAX_IDLE_PER_HOST:
            conn.close()
        else:
            idle.append(conn)

    def _forget(self, key: _Key, conn: _Connection) -> None:
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(
        self, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        key = (host, port, tls)
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key, loop), host, port,
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

    def _checkout(self, key: _Key) -> _Connection | None:
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

    async def _exchange(self, key: _Key, conn: _Connection | None, payload: bytes) -> Response:
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


def _content_type(headers: dict[bytes, bytes]) -> bytes | None:
    """The Content-Type of an answer that spells the name in neither usual way."""
    for name, value in headers.items():
        if len(name) == 12 and name.lower() == b"content-type":
            return value
    return None


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
