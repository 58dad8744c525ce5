"""What a connection of llmgw's server is held to: its deadlines, and the refusal that ends it.

Three deadlines: a request's head must be complete ``HEAD_TIMEOUT_S`` after
its first byte (or the connection's opening), its body ``BODY_TIMEOUT_S``
after its head, and an idle keep-alive connection closes after the server's
keep-alive time. Each is one timer per connection, not per request: the
connection notes when a clock starts (``_head_since``, ``_body_since``,
``_idle_since``) and arms the timer only if none is armed; a timer that
fires early re-arms for what is left (arming and cancelling one per request
cost more than the rest of a head's checks, ~2.5 % of the gateway's CPU for
the keep-alive timer alone).

This is the base of :class:`llmgw.http.connection.LeanHttpProtocol` rather
than an object of its own because the clocks are set from the parser's
callbacks on every request, where a call to another object would cost each
request a frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

# A request's head must be complete this long after its first byte (or the
# connection's opening): a client trickling a byte a minute holds no
# connection for long.
HEAD_TIMEOUT_S = 10.0
# A request's body must be complete this long after its head: a client
# trickling its body holds its connection (and, on the control plane, a
# route waiting for the body) no longer. Generous for the largest bodies
# llmgw takes (a 48 MiB usage batch, a transcription's audio upload) over a
# slow link.
BODY_TIMEOUT_S = 120.0


class Pending(Protocol):
    """A request of the connection, as a refusal ends it (llmgw.http.cycle.RequestCycle)."""

    complete: bool
    started: bool

    def gone(self) -> None: ...


def refusal(status: int, message: str, default_headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A plain-text answer the server writes itself before it closes the connection."""
    return b"".join([
        STATUS_LINE[status],
        *(b"%s: %s\r\n" % pair for pair in default_headers),
        b"content-type: text/plain; charset=utf-8\r\n",
        b"content-length: %d\r\n" % len(message),
        b"connection: close\r\n\r\n",
        message.encode("ascii"),
    ])  # fmt: skip


class ConnectionGuards:
    """The deadline timers and refusals of a connection (see the module's docstring)."""

    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    keep_alive_s: float

    # The connection's, read here.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    logger: logging.Logger
    server_state: Any
    read_paused: bool
    # The request being parsed, the one being answered, those waiting their turn.
    parsing: Pending | None
    active: Pending | None
    pipeline: Iterable[tuple[Pending, Any]]

    # When each clock started (None: not running) and its timer (None: none armed).
    _head_since: float | None = None
    _head_timer: asyncio.TimerHandle | None = None
    _body_since: float | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _idle_since: float | None = None
    _keep_alive_timer: asyncio.TimerHandle | None = None

    def refuse(self, status: int, message: str, *, answer: bool = True) -> None:
        """Close the connection under its requests, with a plain-text answer (``answer``).

        Requests still running write nothing more: for them the client left.
        """
        for request in {self.active, self.parsing, *(e for e, _ in self.pipeline)}:
            if request is not None and not request.complete:
                request.gone()
        if answer:
            self.transport.write(refusal(status, message, self.server_state.default_headers))
        self.transport.close()

    def cancel_deadlines(self) -> None:
        for timer in (self._head_timer, self._keep_alive_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._keep_alive_timer = self._body_timer = None

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

    def _arm_body_timer(self, delay_s: float) -> None:
        self._body_timer = self.loop.call_later(delay_s, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        since = self._body_since
        if since is None or self.transport.is_closing():
            return  # between bodies: the next head arms a timer again
        left = since + self.body_timeout_s - self.loop.time()
        if left <= 0 and self.read_paused:
            # Reading is paused by this server (a pipelined request waiting
            # its turn, or a body the app has not taken yet): not the
            # client's slowness. The deadline starts over once it reads again.
            self._body_since = since = self.loop.time()
            left = self.body_timeout_s
        if left > 0:
            self._arm_body_timer(left)
            return
        self.logger.info("Request body not complete within %g s; closing.", self.body_timeout_s)
        # Answered only if the late body's request is the one being answered
        # and its answer has not begun.
        late = self.parsing
        self.refuse(
            408, f"The request body was not complete within {self.body_timeout_s:g} s.",
            answer=late is not None and late is self.active and not late.started,
        )  # fmt: skip

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
