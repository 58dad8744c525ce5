"""An llmgw app under any ASGI server: a :class:`~llmgw.http.contract.Reply` made of ASGI's send.

llmgw's own server hands an app a Reply and the request's header index; any
other server (uvicorn's protocols, which tests run apps under) hands it
ASGI's ``send`` alone. :func:`as_asgi` wraps an app so that it gets the same
contract there, at the cost of a frame and a few dicts per request, which
is why llmgw's servers never use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from llmgw.http.contract import HEADERS_EXTENSION, App, Asgi, Message, Receive, Scope, Send

# A request answered faster than this never pays for a disconnect watcher (a
# task per request); a client that leaves a long answer is noticed at most
# this late.
WATCH_AFTER_S = 0.05


def as_asgi(app: App) -> Asgi:
    """``app`` as a plain ASGI application, for a server other than llmgw's."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            extensions = dict(scope.get("extensions") or {})
            extensions[HEADERS_EXTENSION] = dict(reversed(scope["headers"]))
            scope = {**scope, "extensions": extensions}
        reply = AsgiReply(send, receive)
        try:
            await app(scope, receive, reply)
        finally:
            reply.close()

    return asgi


class AsgiReply:
    """A :class:`~llmgw.http.contract.Reply` over ASGI's ``send`` (see the module's docstring).

    The client's leaving is learnt as ASGI apps learn it: a task waiting
    for ``http.disconnect`` once the body is read, started only if the
    answer takes longer than ``WATCH_AFTER_S``.
    """

    def __init__(self, send: Send, receive: Receive) -> None:
        self._send = send
        self._receive = receive
        self._head: Message | None = None  # a stream's start, sent with its first piece
        self._gone = False
        self._done = False
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def disconnected(self) -> bool:
        return self._gone

    def __call__(self, message: Message) -> Awaitable[None]:
        return self._send(message)

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        head = [*headers, (b"content-length", b"%d" % len(body))]
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._head = {"type": "http.response.start", "status": status, "headers": headers}

    async def stream(self, body: bytes, more: bool = True) -> None:
        head, self._head = self._head, None
        if head is not None:
            await self._send(head)
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

    def cancel_if_gone(self) -> None:
        task = asyncio.current_task()
        if task is not None and self._timer is None and not self._done:
            self._timer = task.get_loop().call_later(WATCH_AFTER_S, self._watch, task)

    def close(self) -> None:
        """The app is done with the request: no watcher is wanted any more."""
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def _watch(self, request: asyncio.Task[Any]) -> None:
        if not self._done:
            self._watcher = request.get_loop().create_task(self._wait_for_disconnect(request))

    async def _wait_for_disconnect(self, request: asyncio.Task[Any]) -> None:
        # After the body, the next ASGI message is http.disconnect: the
        # client left, or the server finished the answer (``_done`` is set
        # by then).
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._done:
            self._gone = True
            request.cancel()
