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
connections close after ``KEEP_ALIVE_S``. It also writes an answer's head
together with its body (:class:`_HeadWithBody`): one syscall where uvicorn
makes two.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

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


class _HeadWithBody:
    """The transport as one answer sees it: the head waits for the body's first write.

    uvicorn writes an answer's head on ``http.response.start`` and its body
    on the next message: two syscalls, two segments for the client to wake
    up for, where the gateway sends both in the same breath (the second
    write was ~3 % of the gateway's CPU at 1,000 req/s). A head (or a 100
    Continue) is held until the next write or the loop's next turn,
    whichever comes first, so an answer that starts and then waits (a
    stream before its first event) still sends its head at once. (A body
    that happens to begin like a head is held the same way: harmless, the
    order and the next turn's flush are kept.)
    """

    __slots__ = ("_held", "_loop", "_transport")

    # Bodies larger than this go out in their own write rather than be copied.
    _JOIN_UNDER = 64 * 1024

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) < self._JOIN_UNDER:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif data.startswith(b"HTTP/"):
            self._held = data
            self._loop.call_soon(self._flush)
            return
        self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# Response header names uvicorn's send acts on: an answer naming one in its
# headers is written by uvicorn's own loop.
_ACTED_ON = (b"content-length", b"transfer-encoding", b"connection")


class _DefaultHead:
    """The server's default headers (date, server) as head bytes, made once per list.

    uvicorn replaces ``server_state.default_headers`` with a new list each
    second (the date) and checks and writes every entry of it on every
    answer; here a list is turned into bytes the first time an answer meets
    it. The list held here cannot be freed, so its identity is a safe key.
    """

    __slots__ = ("block", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.block: bytes | None = None

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The bytes of ``headers``, or None if uvicorn's loop must write them."""
        if headers is not self.headers:
            self.headers = headers
            self.block = self._render(headers)
        return self.block

    @staticmethod
    def _render(headers: list[tuple[bytes, bytes]]) -> bytes | None:
        lines = []
        for name, value in headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                return None
            name = name.lower()
            if name in _ACTED_ON:
                return None
            lines.append(name + b": " + value + b"\r\n")
        return b"".join(lines)


class _Cycle(RequestResponseCycle):
    """uvicorn's request-response cycle, with the head of a plain answer written without a loop.

    uvicorn's send checks each header of an answer against two regexes,
    lower-cases it and compares its name three times, in Python, the date
    and server headers included (~300 interpreter steps for a gateway
    answer's six headers). Here the names and the values are each checked
    with one regex search over their concatenation (the regexes match one
    character, so that is the same check) and joined in C; an answer the
    fast path does not cover (a header uvicorn acts on besides
    content-length, an upper-case or invalid name or value, an access log, a
    status without a reason phrase) goes through uvicorn's own code, which
    also raises its errors. The bytes written are uvicorn's.
    """

    _defaults = _DefaultHead()

    async def send(self, message: Any) -> None:
        if not (self.flow.write_paused or self.disconnected):
            if self.response_started:
                if self._wrote_body(message):
                    return
            elif message["type"] == "http.response.start":
                head = self._plain_head(message)
                if head is not None:
                    self.response_started = True
                    self.waiting_for_100_continue = False
                    self.transport.write(head)
                    return
        await super().send(message)

    def _wrote_body(self, message: Any) -> bool:
        """uvicorn's body step for the usual case (False: uvicorn's send must take it)."""
        if (
            self.response_complete
            or message["type"] != "http.response.body"
            or self.scope["method"] == "HEAD"
        ):
            return False
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.chunked_encoding:
            if body:
                data = b"".join((b"%x\r\n" % len(body), body, b"\r\n"))
                if not more_body:
                    data += b"0\r\n\r\n"
            else:
                data = b"" if more_body else b"0\r\n\r\n"
            self.transport.write(data)
        else:
            num_bytes = len(body)
            if num_bytes > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= num_bytes
            self.transport.write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
        return True

    def _plain_head(self, message: Any) -> bytes | None:
        """The head uvicorn would write for ``message``, or None where uvicorn must write it."""
        headers = message.get("headers", ())
        if self.access_log or type(headers) not in (list, tuple):
            return None
        defaults = self._defaults.of(self.default_headers)
        if defaults is None:
            return None
        chunked: bool | None = None
        length = 0
        try:
            status = message["status"]
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
            return None  # uvicorn's loop raises its own error for it
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        if chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        self.chunked_encoding = chunked
        self.expected_content_length = length
        lines.append(b"\r\n")
        return b"".join(lines)


# What a tuple of header names means to _Cycle._plain_head: the index of the
# first content-length (-1: none), or _UNFIT for names it leaves to uvicorn.
# An app answers with a few sets of names, so checking each set once (and
# not each answer's names) is the usual case.
_UNFIT = -2
_NAMES: dict[tuple[bytes, ...], int] = {}
_NAMES_KEPT = 256


def _names_fit(names: tuple[bytes, ...]) -> int:
    joined = b"".join(names)
    if (
        HEADER_RE.search(joined)  # one character: the same as a search of each name
        or not joined.islower()  # uvicorn writes names lower-cased
        or b"transfer-encoding" in names
        or b"connection" in names
    ):
        at = _UNFIT
    else:
        at = names.index(b"content-length") if b"content-length" in names else -1
    if len(_NAMES) < _NAMES_KEPT and all(type(name) is bytes for name in names):
        _NAMES[names] = at
    return at


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on request heads.

    It also does less per request than uvicorn's (the gateway's CPU per
    request is mostly this protocol, the event loop and the syscalls): the
    keep-alive timer is armed once per connection, not per answer (see
    :meth:`on_response_complete`), a plain path skips httptools' URL parser,
    and the head-with-body transport is made once per connection.
    """

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        # When the head in progress began (its first byte, or the connection
        # opening); None between requests.
        self._head_since: float | None = None
        self._head_bytes = 0
        # When the connection last went idle after an answer; None while a
        # request is in progress (any byte received ends the idle time).
        self._idle_since: float | None = None
        self._answers: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._answers = cast(asyncio.Transport, _HeadWithBody(transport, self.loop))
        self._head_since = self.loop.time()
        self._arm_head_timer(self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        # A timer per request (armed here, cancelled at the head's end) cost
        # more than the rest of this protocol's checks: one timer per
        # connection instead, re-armed for what is left when it finds a head
        # in progress that is younger than the limit.
        if self._head_since is None:
            self._head_since = self.loop.time()
        if self._head_timer is None:
            self._arm_head_timer(self._head_since + self.head_timeout_s - self.loop.time())

    # uvicorn's on_url and on_header, with the head's size counted inline
    # (one call per header instead of three: a request has a handful).
    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large()
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large()
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 5.5 excludes from the value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """uvicorn's, but for a plain path (no query, escape or fragment) decoded as it is.

        httptools.parse_url was ~4 % of the gateway's CPU at 1,000 req/s, for
        "/v1/chat/completions" every time. Any other URL (an absolute form
        too) still goes through it.
        """
        self._head_since = None
        parser = self.parser
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            return
        url = self.url
        if (
            url[:1] == b"/"
            and url.isascii()
            and b"?" not in url
            and b"%" not in url
            and b"#" not in url
        ):
            raw_path, path, query = url, url.decode("ascii"), b""
        else:
            parsed_url = httptools.parse_url(url)
            raw_path = parsed_url.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            query = parsed_url.query or b""
        root_path = self.root_path
        scope["path"] = root_path + path
        scope["raw_path"] = root_path.encode("ascii") + raw_path
        scope["query_string"] = query

        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        else:
            app = self.app

        existing_cycle = self.cycle
        self.cycle = _Cycle(
            scope=scope,
            transport=self._answers or self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        if existing_cycle is None or existing_cycle.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:
            # Pipelined requests wait their turn.
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn calls this on every read to cancel the keep-alive timer:
        # here the timer stays armed and finds the connection busy.
        self._idle_since = None

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive timer armed once per idle stretch, not per answer.

        uvicorn arms a timer after every answer and cancels it at the next
        request's first byte (the arming alone was ~2.5 % of the gateway's
        CPU at 1,000 req/s). Here an answer only notes when the connection
        went idle; a timer already armed stays, and when it fires it closes
        the connection, re-arms for what is left of a later idle time, or
        lapses while a request is in progress.
        """
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self._arm_keep_alive(self.timeout_keep_alive)

    def _arm_keep_alive(self, delay_s: float) -> None:
        self.timeout_keep_alive_task = self.loop.call_later(
            delay_s, self.timeout_keep_alive_handler
        )

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None:
            return  # a request in progress: its answer arms the timer again
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self._arm_keep_alive(left)
        elif not self.transport.is_closing():
            self.transport.close()

    def _head_too_large(self) -> None:
        # Raised inside httptools' callback: uvicorn answers 400 and closes.
        raise ValueError(f"request head over {self.max_head_bytes} bytes")

    def _arm_head_timer(self, delay_s: float) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(max(0.0, delay_s), self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

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
