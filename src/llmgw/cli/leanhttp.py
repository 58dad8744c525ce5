"""The gateway's HTTP/1.1 server protocol: httptools and the event loop, without uvicorn's cycle.

uvicorn's protocol (even trimmed, :mod:`llmgw.cli.httpserver`) was about a
quarter of the gateway's Python work per request: ~47 interpreter steps per
request header, a ``RequestResponseCycle`` and an ``asyncio.Event`` per
request, a wrapper coroutine on the request's stack at every resume, a
coroutine per ``send``, a per-header loop for each answer's head. This one
serves the same ASGI apps under the same ``uvicorn.Server`` (sockets, TLS,
signals, graceful shutdown, the date header, the connection limit), with:

* headers collected by a three-step callback and looked at once per request,
  into a dict the gateway reads (``scope["extensions"]["llmgw.headers"]``);
* a request body that arrived with its head handed to ``receive`` at once,
  with no event to wait on (a future only when the app must wait);
* the app's task running the endpoint itself: an app with ``route_for``
  (the gateway) names it before the task starts, and what uvicorn's wrapper
  coroutine did around the app happens in the task's done callback;
* ``send`` a plain function returning a finished future, a plain answer's
  head rendered without a per-header loop and written with its body.

Kept from uvicorn (tests/gateway/test_server_protocol.py compares the bytes):
keep-alive and pipelining, chunked request bodies, streamed answers with
backpressure, ``http.disconnect`` for a client that leaves, 100-continue,
HEAD, HTTP/1.0, 400 for a malformed request, 500 for an app that fails, the
access log; from llmgw's guarded protocol, the head's deadline and size cap
and the keep-alive timer armed once per idle stretch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import (
    get_client_addr,
    get_local_addr,
    get_path_with_query_string,
    get_remote_addr,
    is_ssl,
)

from llmgw.cli.httpserver import (
    _NAMES,
    _UNFIT,
    HEAD_TIMEOUT_S,
    MAX_HEAD_BYTES,
    _DefaultHead,
    _names_fit,
    server_config,
)

Asgi = Callable[[Any, Any, Any], Awaitable[None]]

HEADERS_EXTENSION = "llmgw.headers"
# Bodies larger than this go out in their own write rather than be copied
# behind the held head.
_JOIN_UNDER = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ERROR_500 = (
    500,
    [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"21"),
        (b"connection", b"close"),
    ],
    b"Internal Server Error",
)


class _Exchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` of that request.

    The request's body is collected here by the protocol's callbacks; the
    answer's state (started, chunked, bytes still owed) is checked as
    uvicorn's cycle checks it, so an app gets the same errors.
    """

    __slots__ = ("body", "chunked", "complete", "continue_", "delivered", "disconnected", "head",
                 "held", "keep_alive", "left", "more_body", "proto", "scope", "started",
                 "waiter")  # fmt: skip

    def __init__(
        self, proto: LeanHttpProtocol, scope: dict[str, Any], head: bool, keep_alive: bool,
        continue_: bool,
    ) -> None:  # fmt: skip
        self.proto = proto
        self.scope = scope
        self.head = head  # a HEAD request: no body is written
        self.keep_alive = keep_alive
        self.continue_ = continue_  # 100 Continue owed at the first receive
        self.body = b""
        self.more_body = True
        self.delivered = False  # the last http.request was handed over
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.chunked: bool | None = None
        self.left = 0  # body bytes a content-length still owes
        # A plain answer's head, kept until its body (one write for both).
        self.held: bytes | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self.waiter = self.proto.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    async def receive(self) -> dict[str, Any]:
        if self.continue_:
            self.continue_ = False
            if not self.started and not self.proto.transport.is_closing():
                self.proto.transport.write(_CONTINUE)
        if not self.delivered:
            while not (self.body or not self.more_body or self.disconnected or self.complete):
                self.proto.resume_reading()
                await self._wait()
            if not (self.disconnected or self.complete):
                body = self.body
                self.body = b""
                more = self.more_body
                if not more:
                    self.delivered = True
                return {"type": "http.request", "body": body, "more_body": more}
        while not (self.disconnected or self.complete):
            await self._wait()
        return {"type": "http.disconnect"}

    def send(self, message: dict[str, Any]) -> Awaitable[None]:
        proto = self.proto
        if proto.write_paused and not self.disconnected:
            return self._send_later(message)
        if not self.disconnected:
            if self.started:
                self.write_body(message)
            else:
                self.write_start(message)
        return proto.done

    async def _send_later(self, message: dict[str, Any]) -> None:
        await self.proto.drain()
        if not self.disconnected:
            if self.started:
                self.write_body(message)
            else:
                self.write_start(message)

    # -- the answer ----------------------------------------------------------

    def write_start(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.start":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
            )
        self.started = True
        self.continue_ = False
        proto = self.proto
        status = message["status"]
        headers = message.get("headers", ())
        if proto.access_log:
            scope: Any = self.scope
            proto.access_logger.info(
                '%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                get_path_with_query_string(scope), scope["http_version"], status,
            )  # fmt: skip
        head = self._plain_head(status, headers)
        if head is None:
            head = self._head(status, headers)
        if self.chunked is False and not self.head:
            self.held = head  # the body follows: one write for both
        else:
            proto.transport.write(head)

    def write_body(self, message: dict[str, Any]) -> None:
        if self.complete:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already"
                " completed."
            )
        if message["type"] != "http.response.body":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
            )
        body = message.get("body", b"")
        more = message.get("more_body", False)
        transport = self.proto.transport
        if self.head:
            self.left = 0
            data = b""
        elif self.chunked:
            if body:
                data = b"%x\r\n%b\r\n" % (len(body), body)
                if not more:
                    data += b"0\r\n\r\n"
            else:
                data = b"" if more else b"0\r\n\r\n"
        else:
            size = len(body)
            if size > self.left:
                raise RuntimeError("Response content longer than Content-Length")
            self.left -= size
            data = body
        held = self.held
        if held is not None:
            self.held = None
            if len(data) < _JOIN_UNDER:
                data = held + data
            else:
                transport.write(held)
        if data:
            transport.write(data)
        if not more:
            if self.left != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.complete = True
            self.wake()
            if not self.keep_alive:
                transport.close()
            self.proto.answered(self)

    def flush(self) -> None:
        """Write a head still held (an app that failed or stopped before its body)."""
        held = self.held
        if held is not None:
            self.held = None
            self.proto.transport.write(held)

    def _plain_head(self, status: int, headers: Any) -> bytes | None:
        """The head of a usual answer, or None where :meth:`_head` must check each header.

        The names and values are each checked with one regex search over
        their concatenation (the regexes match one character, so that is the
        same check as uvicorn's per header); a set of names is checked once
        per process (llmgw.cli.httpserver._names_fit).
        """
        if type(headers) not in (list, tuple):
            return None
        proto = self.proto
        defaults = proto.default_head.of(proto.server_state.default_headers)
        if defaults is None:
            return None
        chunked: bool | None = None
        length = 0
        try:
            lines = [STATUS_LINE[status], defaults]
            if headers:
                names, values = zip(*headers, strict=True)
                at = _NAMES.get(names)
                if at is None:
                    at = _names_fit(names)
                if at is _UNFIT or HEADER_VALUE_RE.search(b"".join(values)):
                    return None
                if at >= 0:
                    length = int(values[at].decode())
                    chunked = False
                lines.append(b"\r\n".join(map(b": ".join, headers)))
                lines.append(b"\r\n")
        except (KeyError, TypeError, ValueError):
            return None  # the full path raises its own error for it
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        if chunked is None and not self.head and status not in (204, 304):
            chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        self.chunked = chunked
        self.left = length
        lines.append(b"\r\n")
        return b"".join(lines)

    def _head(self, status: int, headers: Any) -> bytes:
        """uvicorn's head, header by header, with its errors."""
        content = [STATUS_LINE[status]]
        has_close = False
        for name, value in [*self.proto.server_state.default_headers, *headers]:
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked is None:
                self.left = int(value.decode())
                self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.left = 0
                self.chunked = True
            elif name == b"connection":
                tokens = [token.lower().strip() for token in value.split(b",")]
                if b"close" in tokens:
                    self.keep_alive = False
                    has_close = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not has_close:
            content.append(b"connection: close\r\n")
        if self.chunked is None and not self.head and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)

    # -- the app's end ---------------------------------------------------------

    def ended(self, task: asyncio.Task[Any]) -> None:
        """What uvicorn's wrapper coroutine did after the app: errors answered or logged."""
        proto = self.proto
        proto.tasks.discard(task)
        logger = proto.logger
        try:
            result = task.result()
        except BaseException as exc:  # a cancelled task too, as uvicorn's wrapper catches it
            logger.error("Exception in ASGI application\n", exc_info=exc)
            self.flush()
            if not self.started:
                self._answer_500()
            else:
                proto.transport.close()
            return
        self.flush()
        if result is not None:
            logger.error("ASGI callable should return None, but returned '%s'.", result)
            proto.transport.close()
        elif self.disconnected or self.complete:
            return
        elif not self.started:
            logger.error("ASGI callable returned without starting response.")
            self._answer_500()
        else:
            logger.error("ASGI callable returned without completing response.")
            proto.transport.close()

    def _answer_500(self) -> None:
        if self.disconnected:
            return
        status, headers, body = _ERROR_500
        try:
            self.write_start({"type": "http.response.start", "status": status,
                              "headers": headers})  # fmt: skip
            self.write_body({"type": "http.response.body", "body": body})
        except RuntimeError:
            self.proto.transport.close()


class LeanHttpProtocol(asyncio.Protocol):
    """An HTTP/1.1 connection serving an ASGI app (see the module's docstring)."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    # Shared: keyed by the identity of the server's list of default headers.
    default_head = _DefaultHead()

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
        self.app: Asgi = config.loaded_app
        # An app that names the endpoint for a method and path (the gateway)
        # is skipped: the task runs the endpoint, a frame less on its stack.
        self.route_for: Callable[[str, str], Asgi | None] | None = getattr(
            self.app, "route_for", None
        )
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
        self.fresh_context = bool(getattr(config, "reset_contextvars", False))
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
        self.pipeline: deque[tuple[_Exchange, Asgi]] = deque()
        self.closing = False  # a graceful shutdown: no request after the one in progress

        # The request being parsed, and the one being answered.
        self.parsing: _Exchange | None = None
        self.active: _Exchange | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        # Bytes received since the head in progress began (None: not in a head).
        self._head_bytes: int | None = 0
        self._head_since: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None

    # -- connection ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connections.add(self)
        self.transport = cast(asyncio.Transport, transport)
        self.server = get_local_addr(self.transport)
        self.client = get_remote_addr(self.transport)
        self.scheme = "https" if is_ssl(self.transport) else "http"
        self._head_since = self.loop.time()
        self._arm_head_timer(self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for exchange in (self.active, self.parsing):
            if exchange is not None and not exchange.complete:
                exchange.disconnected = True
                exchange.wake()
        self._writable_again()
        for timer in (self._head_timer, self._keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._keep_alive_timer = None
        if exc is None:
            self.transport.close()

    def eof_received(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self._head_bytes is not None:
            # The head's size, counted per read rather than per header (see
            # on_message_complete for where a count starts).
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.logger.warning("Unsupported upgrade request.")
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self._answer_400(msg)
            return
        counted = self._head_bytes
        if counted is not None and counted > self.max_head_bytes:
            # Still in a head: every byte counted since it began was head.
            self.logger.warning("Request head over %d bytes.", self.max_head_bytes)
            self._answer_400("Invalid HTTP request received.")

    def _answer_400(self, msg: str) -> None:
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: " + str(len(msg)).encode("ascii") + b"\r\n",
            b"connection: close\r\n",
            b"\r\n",
            msg.encode("ascii"),
        ])  # fmt: skip
        self.transport.write(b"".join(content))
        self.transport.close()

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
        self._headers = []
        if self._head_bytes is None:
            self._head_bytes = 0
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
        # llhttp keeps trailing whitespace, which RFC 9110 5.5 excludes from the value.
        self._headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        # The last read may hold body bytes too: only then is the head measured.
        if (self._head_bytes or 0) > self.max_head_bytes and self._head_size() > (
            self.max_head_bytes
        ):
            raise ValueError(f"request head over {self.max_head_bytes} bytes")
        self._head_bytes = None
        self._head_since = None
        parser = self.parser
        version = parser.get_http_version()
        method = parser.get_method().decode("ascii")
        url = self._url
        if (
            url[:1] == b"/"
            and url.isascii()
            and b"?" not in url
            and b"%" not in url
            and (b"#" not in url)
        ):
            # httptools.parse_url was ~4 % of the gateway's CPU, for the same
            # plain path every time.
            raw_path, path, query = url, url.decode("ascii"), b""
        else:
            parsed = httptools.parse_url(url)
            raw_path = parsed.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            query = parsed.query or b""
        root = self.root_path
        if root:
            path = root + path
            raw_path = root.encode("ascii") + raw_path
        headers = self._headers
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
        exchange = _Exchange(
            self, scope, method == "HEAD", version != "1.0" and parser.should_keep_alive()
            and not self.closing,
            expect is not None and expect.lower() == b"100-continue",
        )  # fmt: skip
        self.parsing = exchange
        limit = self.limit
        app: Asgi | None
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            app = service_unavailable
        else:
            route_for = self.route_for
            app = route_for(method, path) if route_for is not None else None
            if app is None:
                app = self.app
        if self.active is None:
            self._start(exchange, app)
        else:
            # Pipelined requests wait their turn.
            self.pause_reading()
            self.pipeline.append((exchange, app))

    def _head_size(self) -> int:
        return len(self._url) + sum(len(n) + len(v) + 4 for n, v in self._headers)

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        if exchange is None or exchange.complete:
            return
        exchange.body += body
        if len(exchange.body) > HIGH_WATER_LIMIT:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self.parsing
        # The next head's count starts with the next read: the rest of this
        # one goes uncounted (a head over the cap by less than a read passes).
        self._head_bytes = 0
        if exchange is None or exchange.complete:
            return
        exchange.more_body = False
        exchange.wake()

    # -- requests ----------------------------------------------------------------

    def _start(self, exchange: _Exchange, app: Asgi) -> None:
        self.active = exchange
        coro: Any = app(exchange.scope, exchange.receive, exchange.send)
        task: asyncio.Task[None]
        if self.fresh_context:
            task = self.loop.create_task(coro, context=contextvars.Context())
        else:
            task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(exchange.ended)

    def answered(self, exchange: _Exchange) -> None:
        """An answer is complete: the next pipelined request, or an idle connection."""
        self.server_state.total_requests += 1
        if self.active is exchange:
            self.active = None
        if self.transport.is_closing():
            return
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

    # -- timers ------------------------------------------------------------------

    def _arm_keep_alive(self, delay_s: float) -> None:
        self._keep_alive_timer = self.loop.call_later(delay_s, self._keep_alive_ended)

    def _keep_alive_ended(self) -> None:
        self._keep_alive_timer = None
        since = self._idle_since
        if since is None:
            return  # a request in progress: its answer arms the timer again
        left = since + self.keep_alive_s - self.loop.time()
        if left > 0:
            self._arm_keep_alive(left)
        elif not self.transport.is_closing():
            self.transport.close()

    def _arm_head_timer(self, delay_s: float) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(max(0.0, delay_s), self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        since = self._head_since
        if since is None:
            return  # between requests: the next head arms a timer again
        left = since + self.head_timeout_s - self.loop.time()
        if left > 0:
            self._arm_head_timer(left)
            return
        # Only a connection waiting for a head: an answer in progress (a long
        # stream) is never cut by this timer.
        if self.active is None and not self.transport.is_closing():
            self.transport.close()


def gateway_server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """llmgw's server settings (:func:`llmgw.cli.httpserver.server_config`) with this protocol."""
    return server_config(app, **{"http": LeanHttpProtocol, **kwargs})
