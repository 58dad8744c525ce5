"""One request and its answer on llmgw's HTTP/1.1 server (llmgw.http.connection): receive, send.

Split from the connection's protocol: this is what an app's request sees
(its body, the answer's head and body, the checks uvicorn makes of them),
the protocol what the connection does (parsing, limits, timers, pipelining).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from llmgw.http.answerhead import NAMES_SEEN, UNFIT, names_fit
from llmgw.http.contract import Message

if TYPE_CHECKING:
    from llmgw.http.connection import LeanHttpProtocol

# Bodies larger than this go out in their own write rather than be copied
# behind the held head.
_JOIN_UNDER = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Answers after which the connection closes whatever the client asked: the
# client was refused, and a connection kept open for a client without a
# credential (or with a body it will not finish) is a slot held for nothing.
CLOSE_AFTER = frozenset({401, 408, 413})
_ERROR_500 = (
    500,
    [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"21"),
        (b"connection", b"close"),
    ],
    b"Internal Server Error",
)


class RequestCycle:
    """One request and its answer: the ASGI ``receive`` and ``send`` of that request.

    The request's body is collected here by the protocol's callbacks; the
    answer's state (started, chunked, bytes still owed) is checked as
    uvicorn's cycle checks it, so an app gets the same errors.
    """

    # Defaults as class attributes (no __slots__): a request sets only the
    # five values it is made with, and the rest where they change.
    body = b""
    more_body = True
    delivered = False  # the last http.request was handed over
    disconnected = False
    waiter: asyncio.Future[None] | None = None
    started = False
    complete = False
    chunked: bool | None = None
    left = 0  # body bytes a content-length still owes
    # A plain answer's head, kept until its body (one write for both).
    held: bytes | None = None
    task: asyncio.Task[None] | None = None  # the app's, for this request
    watched = False  # cancel the task if the client leaves before the answer's end

    def __init__(
        self, proto: LeanHttpProtocol, scope: dict[str, Any], head: bool, keep_alive: bool,
        continue_: bool,
    ) -> None:  # fmt: skip
        self.proto = proto
        self.scope = scope
        self.head = head  # a HEAD request: no body is written
        self.keep_alive = keep_alive
        self.continue_ = continue_  # 100 Continue owed at the first receive

    def cancel_if_gone(self) -> None:
        """Cancel the app's task if the client leaves before the answer is complete.

        What an ASGI app learns by a task of its own waiting for
        ``http.disconnect``, without that task (the gateway cancels the
        engine's work for a client that left).
        """
        self.watched = True

    def gone(self) -> None:
        """The connection closed before the answer was complete."""
        self.disconnected = True
        if self.waiter is not None:
            self.wake()
        task = self.task
        if self.watched and task is not None and not task.done():
            task.cancel()

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

    def send(self, message: Message) -> Awaitable[None]:
        proto = self.proto
        if proto.write_paused and not self.disconnected:
            return self._send_later(message)
        if not self.disconnected:
            if self.started:
                self.write_body(message)
            else:
                self.write_start(message)
        return proto.done

    # The app's ``send`` is the exchange itself: :meth:`answer` rides along.
    __call__ = send

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Awaitable[None]:
        """A whole answer in one write, with no ASGI message: the gateway's usual answer.

        ``headers`` are the caller's own, trusted as they are: lower-case
        names, values without control characters, and none of
        content-length, transfer-encoding or connection (this adds them).
        Awaitable as ``send`` (already done: the write never waits).
        """
        proto = self.proto
        if self.disconnected:
            return proto.done
        if self.started:
            raise RuntimeError("answer() after the answer started")
        if status in CLOSE_AFTER:
            self.keep_alive = False
        defaults = proto.default_head.of(proto.server_state.default_headers)
        if defaults is None or proto.access_log:
            self.write_start(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*headers, (b"content-length", b"%d" % len(body))],
                }
            )
            self.write_body({"type": "http.response.body", "body": body})
            return proto.done
        self.started = True
        self.continue_ = False
        parts = [STATUS_LINE[status], defaults]
        if headers:
            parts.append(b"\r\n".join(map(b": ".join, headers)))
            parts.append(b"\r\ncontent-length: %d\r\n" % len(body))
        else:
            parts.append(b"content-length: %d\r\n" % len(body))
        keep_alive = self.keep_alive
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if not self.head:
            parts.append(body)
        transport = proto.transport
        transport.write(b"".join(parts))
        self.complete = True
        if self.waiter is not None:
            self.wake()
        if not keep_alive:
            proto.close_after_answer()
        proto.answered(self)
        return proto.done

    async def _send_later(self, message: Message) -> None:
        await self.proto.drain()
        if not self.disconnected:
            if self.started:
                self.write_body(message)
            else:
                self.write_start(message)

    # -- the answer ----------------------------------------------------------

    def write_start(self, message: Message) -> None:
        if message["type"] != "http.response.start":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
            )
        self.started = True
        self.continue_ = False
        proto = self.proto
        status = message["status"]
        if status in CLOSE_AFTER:
            self.keep_alive = False
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

    def write_body(self, message: Message) -> None:
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
                self.proto.close_after_answer()
            self.proto.answered(self)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a streamed (chunked) answer with no ASGI message; see :meth:`stream`.

        ``headers`` are trusted as in :meth:`answer`. The head is held for
        the first :meth:`stream` call (one write for both): the caller makes
        that call before it waits for anything.
        """
        if self.disconnected:
            return
        proto = self.proto
        defaults = proto.default_head.of(proto.server_state.default_headers)
        if defaults is None or proto.access_log or self.head or self.started:
            self.write_start({"type": "http.response.start", "status": status,
                              "headers": headers})  # fmt: skip
            return
        self.started = True
        self.continue_ = False
        self.chunked = True
        parts = [STATUS_LINE[status], defaults]
        if headers:
            parts.append(b"\r\n".join(map(b": ".join, headers)))
            parts.append(b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        self.held = b"".join(parts)

    def stream(self, body: bytes, more: bool = True) -> Awaitable[None]:
        """The next piece of an answer begun with :meth:`start` (``more`` False: the last).

        Awaitable as ``send``: it waits while the client does not read.
        """
        proto = self.proto
        if self.disconnected:
            return proto.done
        held = self.held
        if (
            proto.write_paused
            or not self.chunked
            or self.complete
            or (held is not None and len(body) >= _JOIN_UNDER)
        ):
            return self.send({"type": "http.response.body", "body": body, "more_body": more})
        if body:
            data = b"%x\r\n%b\r\n" % (len(body), body)
            if not more:
                data += b"0\r\n\r\n"
        elif more:
            data = b""
        else:
            data = b"0\r\n\r\n"
        if held is not None:
            self.held = None
            data = held + data
        if data:
            proto.transport.write(data)
        if not more:
            self.complete = True
            if self.waiter is not None:
                self.wake()
            if not self.keep_alive:
                proto.close_after_answer()
            proto.answered(self)
        return proto.done

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
        per process (llmgw.http.answerhead.names_fit).
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
                at = NAMES_SEEN.get(names)
                if at is None:
                    at = names_fit(names)
                if at == UNFIT or HEADER_VALUE_RE.search(b"".join(values)):
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
        try:
            result = task.result()
        except BaseException as exc:  # a cancelled task too, as uvicorn's wrapper catches it
            proto.logger.error("Exception in ASGI application\n", exc_info=exc)
            self.flush()
            if not self.started:
                self._answer_500()
            else:
                proto.transport.close()
            return
        if result is None and self.complete:
            return  # the usual end
        self.flush()
        logger = proto.logger
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
