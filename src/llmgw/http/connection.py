"""The gateway's HTTP/1.1 server protocol: httptools and the event loop, without uvicorn's cycle.

uvicorn's own protocol costs about a quarter of the gateway's Python work
per request: ~47 interpreter steps per request header, a
``RequestResponseCycle`` and an ``asyncio.Event`` per request, a wrapper
coroutine on the request's stack at every resume, a coroutine per ``send``,
a per-header loop for each answer's head. This one serves the same ASGI apps
under the same ``uvicorn.Server`` (sockets, TLS, signals, graceful
shutdown, the date header, the connection limit), with:

* headers collected by a three-step callback and indexed once per request
  (llmgw.http.contract.request_headers);
* a request body that arrived with its head handed to ``receive`` at once,
  with no event to wait on (a future only when the app must wait);
* the app's task running the endpoint itself (llmgw.http.contract.App), and
  what uvicorn's wrapper coroutine did around the app in the task's done
  callback;
* the request's Reply (:mod:`llmgw.http.cycle`: receive, send, the answer's
  checks) writing an answer's head without a per-header loop, with its body.

Kept from uvicorn (tests/http/test_server_protocol.py compares the bytes):
keep-alive and pipelining, chunked request bodies, streamed answers with
backpressure, ``http.disconnect`` for a client that leaves, 100-continue,
HEAD, HTTP/1.0, 400 for a malformed request, 500 for an app that fails, the
access log. Added: the head's size cap, the deadlines of
:mod:`llmgw.http.guards` (uvicorn bounds neither a head's time nor its
size; :mod:`llmgw.http.server` has the settings every llmgw server runs
this protocol with), a cap on connections per client address, and a
connection closed after an answer that refuses its request (401, 408, 413).

Why per address (llmgw.addresscap): uvicorn's ``limit_concurrency`` counts
all connections together, so one address that keeps a few thousand slow
connections open (each a byte every few seconds, never finishing its head)
makes every other client's request a 503, ``/healthz`` included. Past
``max_per_address`` open connections from one address, a new connection
from it is answered 503 and closed at once, before anything is read, so
the rest of the connection limit stays for everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import operator
import weakref
from collections import deque
from typing import Any, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.utils import (
    get_local_addr,
    get_remote_addr,
    is_ssl,
)

from llmgw.addresscap import AddressCounts, max_per_address_from_env
from llmgw.http.answerhead import DefaultHead
from llmgw.http.contract import HEADERS_EXTENSION, App, Endpoint
from llmgw.http.cycle import RequestCycle
from llmgw.http.guards import ConnectionGuards
from llmgw.http.target import PLAIN_PATHS, parse_target

_TASK_NAME = "llmgw-request"
# Large enough for any OpenAI client's headers (a long bearer token, tracing
# headers), small enough that a head never matters for memory.
MAX_HEAD_BYTES = 64 * 1024
# How long, and for how many bytes, a connection closed under a body still
# arriving reads and drops it (close_after_answer).
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024
_STRIP_OWS = operator.methodcaller("rstrip", b" \t")
# uvicorn's 503 past the connection limit, an ASGI app as any other (its
# own types spell ASGI's messages out).
_UNAVAILABLE = cast(Endpoint, service_unavailable)
_OVER_PER_ADDRESS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: 41\r\n\r\n"
    b"Too many connections from this address.\r\n"
)

# The open connections per client address of each server, shared by its
# connections (keyed by uvicorn's state of the server).
_PER_ADDRESS: weakref.WeakKeyDictionary[Any, AddressCounts] = weakref.WeakKeyDictionary()


def _per_address(server_state: Any, cap: int) -> AddressCounts:
    counts = _PER_ADDRESS.get(server_state)
    if counts is None or counts.cap != cap:
        counts = _PER_ADDRESS[server_state] = AddressCounts(cap)
    return counts


class LeanHttpProtocol(ConnectionGuards, asyncio.Protocol):
    """An HTTP/1.1 connection serving an ASGI app (see the module's docstring)."""

    max_head_bytes = MAX_HEAD_BYTES
    # None: LLMGW_MAX_CONNECTIONS_PER_ADDRESS or its default (llmgw.addresscap);
    # tests set a number here.
    max_per_address: int | None = None
    # Shared: keyed by the identity of the server's list of default headers.
    default_head = DefaultHead()

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app: Endpoint = config.loaded_app
        # The app's endpoints are run without its dispatch: the task runs the
        # endpoint, a frame less on its stack at every resume. server_config
        # takes nothing but an App, whose endpoints these are.
        self.endpoints = cast(App, config.app).endpoints
        self.loop = _loop or asyncio.get_event_loop()
        self.logger = logging.getLogger("uvicorn.error")
        self.access_logger = logging.getLogger("uvicorn.access")
        self.access_log = self.access_logger.hasHandlers()
        self.parser = httptools.HttpRequestParser(self)
        # As uvicorn: answer the first of pipelined requests sent with a close
        # (no such setting before httptools 0.6.3).
        with contextlib.suppress(AttributeError):
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.root_path: str = config.root_path
        self.asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.limit = config.limit_concurrency
        # uvicorn's own setting, which the older uvicorns pyproject.toml
        # allows do not have.
        self.fresh_context = bool(getattr(config, "reset_contextvars", False))
        # Tasks made as the loop would make them, but named: unnamed, each
        # task formats a "Task-<n>" of its own (Python 3.11; ~10 % of a
        # task's cost). A loop with a task factory makes its own.
        self.plain_tasks = self.loop.get_task_factory() is None
        self.app_state = app_state
        self.keep_alive_s = config.timeout_keep_alive
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks

        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.done.set_result(None)
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self.pipeline: deque[tuple[RequestCycle, Endpoint]] = deque()
        self.closing = False  # a graceful shutdown: no request after the one in progress

        # The request being parsed, and the one being answered.
        self.parsing: RequestCycle | None = None
        self.active: RequestCycle | None = None
        self._url = b""
        # The head's header names and values in turn, as httptools hands them over.
        self._raw: list[bytes] = []
        # Bytes received since the head in progress began (None: not in a head).
        self._head_bytes: int | None = 0
        # A message completed in the read being parsed; and the head in
        # progress began after one, mid-read (its first bytes went uncounted).
        self._completed_in_read = False
        self._head_mid_read = False
        cap = self.max_per_address
        self.per_address = _per_address(
            server_state, max_per_address_from_env() if cap is None else cap)
        self.address: str | None = None  # counted in per_address under this key
        self.refused = False  # over its address's cap: answered 503 and closed
        # Bytes still to drop after close_after_answer half-closed it; None: not closing.
        self.lingering: int | None = None

    # -- connection ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.client = get_remote_addr(self.transport)
        if self.client is not None:
            self.address = self.per_address.take(self.client[0])
            if self.address is None:
                self.refused = True
                self.transport.write(_OVER_PER_ADDRESS)
                self.transport.close()
                return
        self.connections.add(self)
        self.server = get_local_addr(self.transport)
        self.scheme = "https" if is_ssl(self.transport) else "http"
        self._head_since = self.loop.time()
        self._arm_head_timer(self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if self.address is not None:
            self.per_address.give(self.address)
            self.address = None
        for exchange in {self.active, self.parsing}:
            if exchange is not None and not exchange.complete:
                exchange.gone()
        self._writable_again()
        self.cancel_deadlines()
        if exc is None:
            self.transport.close()

    def eof_received(self) -> None:
        pass

    def close_after_answer(self) -> None:
        """Close once an answer that ends the connection is written.

        A client may still be sending the body the answer refused (a 413 for
        its declared length, a 401 before the body): a socket closed with
        unread bytes makes the kernel send a reset, and a reset can destroy
        the answer before the client reads it. So while a body is still
        arriving, only this side's half is closed, and what comes is read and
        dropped for a bounded time and size, as web servers linger.
        """
        transport = self.transport
        if transport.is_closing() or self.lingering is not None:
            return
        if self._body_since is None or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.lingering = LINGER_BYTES
        if self.read_paused:
            self.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # over its address's cap (connection_made): closing
        if self.lingering is not None:
            self.lingering -= len(data)
            if self.lingering < 0:
                self.transport.close()
            return
        self._idle_since = None
        if self._head_bytes is not None:
            # The head's size, counted per read rather than per header (see
            # on_message_complete for where a count starts).
            self._head_bytes += len(data)
        self._completed_in_read = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.logger.warning("Unsupported upgrade request.")
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.refuse(400, msg)
            return
        counted = self._head_bytes
        if counted is not None and counted > self.max_head_bytes:
            # Still in a head: every byte counted since it began was head.
            self.logger.warning("Request head over %d bytes.", self.max_head_bytes)
            self.refuse(400, "Invalid HTTP request received.")

    # -- flow control ------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self._writable_again()

    def _writable_again(self) -> None:
        self.write_paused = False
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        while self.write_paused:
            if self._writable is None:
                self._writable = self.loop.create_future()
            await asyncio.shield(self._writable)

    # -- parser callbacks --------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._raw = []
        if self._head_bytes is None:
            self._head_bytes = 0
        if self._completed_in_read:
            self._head_mid_read = True  # pipelined: measured whole at its end
        # One head timer per connection, re-armed for what is left of the
        # limit when it finds a head in progress (a timer per request cost
        # more than the rest of the head's checks).
        if self._head_since is None:
            self._head_since = self.loop.time()
        if self._head_timer is None:
            self._arm_head_timer(self._head_since + self.head_timeout_s - self.loop.time())

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only kept here (12 interpreter steps a header, a real client sends
        # ~14): lower-cased and stripped in C at the head's end.
        self._raw += (name, value)

    def on_headers_complete(self) -> None:
        # The last read may hold body bytes too: only then is the head measured.
        if ((self._head_bytes or 0) > self.max_head_bytes or self._head_mid_read) and (
            self._head_size() > self.max_head_bytes
        ):
            raise ValueError(f"request head over {self.max_head_bytes} bytes")
        self._head_bytes = None
        self._head_mid_read = False
        self._head_since = None
        # The body's deadline, one timer per connection as the head's (a
        # request without a body completes in this same read and clears it).
        self._body_since = self.loop.time()
        if self._body_timer is None:
            self._arm_body_timer(self.body_timeout_s)
        parser = self.parser
        version = parser.get_http_version()
        method = parser.get_method().decode("ascii")
        url = self._url
        root = self.root_path
        path = PLAIN_PATHS.get(url)
        if path is not None and not root:
            raw_path, query = url, b""
        else:
            path, raw_path, query = parse_target(url, root)
        raw = self._raw
        # llhttp keeps trailing whitespace, which RFC 9110 5.5 excludes from the value.
        names, values = map(bytes.lower, raw[::2]), map(_STRIP_OWS, raw[1::2])
        headers = list(zip(names, values, strict=True))
        # The first value of each name (a C-level build; the gateway reads
        # two headers of ~14 a client sends, each with one lookup).
        index = dict(reversed(headers))
        scope = {
            "type": "http", "asgi": self.asgi, "http_version": version, "server": self.server,
            "client": self.client, "scheme": self.scheme, "method": method, "root_path": root,
            "path": path, "raw_path": raw_path, "query_string": query, "headers": headers,
            "state": self.app_state.copy(), "extensions": {HEADERS_EXTENSION: index},
        }  # fmt: skip
        expect = index.get(b"expect")
        exchange = RequestCycle(
            self, scope, method == "HEAD", version != "1.0" and parser.should_keep_alive()
            and not self.closing,
            expect is not None and expect.lower() == b"100-continue",
        )  # fmt: skip
        self.parsing = exchange
        limit = self.limit
        app: Endpoint
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            app = _UNAVAILABLE
        else:
            app = self.endpoints.get((method, path)) or self.app
        if self.active is None:
            self._start(exchange, app)
        else:
            # Pipelined requests wait their turn.
            self.pause_reading()
            self.pipeline.append((exchange, app))

    def _head_size(self) -> int:
        return len(self._url) + sum(map(len, self._raw)) + 2 * len(self._raw)

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        if exchange is None or exchange.complete:
            return
        exchange.body += body
        if len(exchange.body) > HIGH_WATER_LIMIT:
            self.pause_reading()
        if exchange.waiter is not None:
            exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self.parsing
        # The next head's count starts with the next read: the rest of this
        # one goes uncounted, so a head that begins in it (pipelined) is
        # measured whole when it ends (on_message_begin, on_headers_complete).
        self._head_bytes = 0
        self._completed_in_read = True
        self._body_since = None
        if exchange is None or exchange.complete:
            return
        exchange.more_body = False
        if exchange.waiter is not None:
            exchange.wake()

    # -- requests ----------------------------------------------------------------

    def _start(self, exchange: RequestCycle, app: Endpoint) -> None:
        self.active = exchange
        coro: Any = app(exchange.scope, exchange.receive, exchange)
        context = contextvars.Context() if self.fresh_context else None
        task: asyncio.Task[None]
        if self.plain_tasks:
            task = asyncio.Task(coro, loop=self.loop, name=_TASK_NAME, context=context)
        else:
            task = self.loop.create_task(coro, context=context)
        exchange.task = task
        self.tasks.add(task)
        task.add_done_callback(exchange.ended)

    def answered(self, exchange: RequestCycle) -> None:
        """An answer is complete: the next pipelined request, or an idle connection."""
        self.server_state.total_requests += 1
        if self.active is exchange:
            self.active = None
        if self.transport.is_closing() or self.lingering is not None:
            return
        if self.read_paused:
            self.resume_reading()
        if self.pipeline:
            self._start(*self.pipeline.popleft())
            return
        # The keep-alive timer is armed once per idle stretch, not per answer
        # (arming and cancelling one per request was ~2.5 % of the CPU): it
        # closes the connection, re-arms for what is left, or lapses while a
        # request is in progress.
        self._idle_since = self.loop.time()
        if self._keep_alive_timer is None:
            self._arm_keep_alive(self.keep_alive_s)

    def shutdown(self) -> None:
        """A graceful stop: idle connections close, busy ones after their answer."""
        self.closing = True
        active = self.active
        if active is None or active.complete:
            self.transport.close()
            return
        active.keep_alive = False
        for exchange, _ in self.pipeline:
            exchange.keep_alive = False
