"""One keep-alive connection to an upstream and the answer read on it (the hot path's client).

:class:`UpstreamConnection` is the asyncio protocol: it writes a request in
one ``transport.write`` and parses the answer with httptools (status,
headers, body de-chunked); :class:`Response` is that answer as the gateway
reads it: status and headers once known, then the body chunk by chunk (a
relay) or whole. The pool that owns the connections is
:mod:`llmgw.http.client`.

Failure classes, as the gateway needs them:
* :class:`ConnectFailed`: refused, reset or closed before any byte of the
  answer arrived; the request may be retried on another replica.
* :class:`BodyBroken`: the connection broke after the answer began.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import httptools

if TYPE_CHECKING:
    from llmgw.http.client import Pool

_HIGH_WATER = 1 << 20  # buffered answer bytes before a streamed answer stops being read
# The largest answer read whole (non-streamed). Embeddings of a large batch
# run to tens of MB; anything far past that is an engine gone wrong, and
# buffering it would let one answer take the gateway's memory.
MAX_ANSWER_BYTES = 256 << 20
# An answer's head past this is no engine's: refused as a broken answer.
# Without a cap, an upstream sending header lines without end (an external
# model's host, a hostile engine) grew the gateway's memory until the
# request's deadline (found by bench/fuzz.py).
MAX_HEAD_BYTES = 256 << 10

# Connections are pooled per (host, port, TLS context): an https upstream
# never shares a pool with a plain engine, nor one verified against the
# fleet's CA (an engine llmgw runs) with one verified against the system's
# CAs (an external model's hosted API).
Key = tuple[str, int, ssl.SSLContext | None]


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

    def __init__(self, conn: UpstreamConnection) -> None:
        self._conn: UpstreamConnection | None = conn
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
        # Read whole, the answer is bounded by the size cap, not the
        # high-water mark: a socket that mark paused must read again, or the
        # answer never completes and the request waits for its deadline.
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


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an upstream (an engine, an external model's host)."""

    def __init__(self, pool: Pool, key: Key, loop: asyncio.AbstractEventLoop) -> None:
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


def _content_type(headers: dict[bytes, bytes]) -> bytes | None:
    """The Content-Type of an answer that spells the name in neither usual way."""
    for name, value in headers.items():
        if len(name) == 12 and name.lower() == b"content-type":
            return value
    return None

