"""The contract between llmgw's HTTP server and the apps it runs, as types.

An app (the gateway, the control plane, a dispatcher in front of both) is an
ASGI callable that also names :attr:`App.endpoints`: routes the server runs
by (method, path) itself, with no frame of the app's dispatch on the
request's stack. The server hands each request a :class:`Reply`: ASGI's
``send``, plus what lets an answer skip ASGI's message dicts (a whole
answer in one write, a stream of plain bytes) and learn, without a task of
its own, that its client left. It also indexes the request's headers once
(:func:`request_headers`).

Everything here is structural: the server's :class:`~llmgw.http.cycle.RequestCycle`
is a Reply, and :func:`llmgw.http.asgi.as_asgi` makes one over any other
server's ``send`` (tests run apps under uvicorn's own protocol), so an app
never asks which server it runs under.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# Any ASGI application, as a server calls it.
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

# The key under scope["extensions"] of the request's headers by lower-case
# name, the first value of each: indexed once per request, in C, by the
# server (an app reads two or three of the ~14 headers a client sends).
HEADERS_EXTENSION = "llmgw.headers"


class Reply(Protocol):
    """How an app answers one request: ASGI's ``send``, and the same answer without messages.

    Headers given to :meth:`answer` and :meth:`start` are the app's own,
    trusted as they are: lower-case names, values without control
    characters, and none of content-length, transfer-encoding or connection
    (the server adds those). A request answers either through ASGI messages
    (calling the Reply) or through these methods, not both.
    """

    @property
    def disconnected(self) -> bool:
        """The client left before the answer was complete."""
        ...

    def __call__(self, message: Message) -> Awaitable[None]:
        """ASGI's ``send``."""
        ...

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Awaitable[None]:
        """A whole answer (the server adds its content-length): one write where it can."""
        ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Begin a streamed (chunked) answer; its head waits for the first :meth:`stream`.

        The caller makes that first call before it waits for anything else,
        so the head and the first bytes leave together.
        """
        ...

    def stream(self, body: bytes, more: bool = True) -> Awaitable[None]:
        """The next piece of an answer begun with :meth:`start` (``more`` False: the last).

        It waits while the client does not read.
        """
        ...

    def cancel_if_gone(self) -> None:
        """From now on, cancel the request's task if the client leaves before the answer's end.

        What an app would otherwise learn from a task of its own waiting for
        ``http.disconnect``; the task, once cancelled, finds
        :attr:`disconnected` true.
        """
        ...


Endpoint = Callable[[Scope, Receive, Reply], Awaitable[None]]


class App(Protocol):
    """An ASGI app as llmgw's server runs it: its endpoints apart, everything else through it."""

    @property
    def endpoints(self) -> Mapping[tuple[str, str], Endpoint]:
        """(method, path) -> what serves it; the server calls these directly (exact paths)."""
        ...

    def __call__(self, scope: Scope, receive: Receive, send: Reply) -> Awaitable[None]: ...


def request_headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name, the first value of each (see HEADERS_EXTENSION)."""
    return scope["extensions"][HEADERS_EXTENSION]  # type: ignore[no-any-return]
