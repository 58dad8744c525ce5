"""Request body limits for the control plane, enforced before a route runs.

Without them every route read whatever it was sent into memory, and
``/agent/v1/register`` did so before looking at the join token: anyone who
could reach the port could make the control plane hold gigabytes. This ASGI
middleware refuses a declared ``Content-Length`` over the route's limit with
413 before the application sees the request, counts the bytes of a chunked
(undeclared) body as they arrive and stops at the limit, and gives up on a
body whose next piece takes longer than ``idle_s`` or that is not complete
``total_s`` after the route first asked for it (a client trickling a body a
byte at a time, each byte inside the idle limit, would otherwise hold a
request open for as long as it liked). llmgw's HTTP server
(llmgw.http.connection) has a body deadline of its own; this one holds under
any server.

Limits go by path prefix, the longest match first: registration is small
(a name, a token, an inventory), a gateway's usage batch after a long outage
is the largest legitimate body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MiB = 1024 * 1024
# (path prefix, bytes). An inventory of a large MIG node is tens of KB; a
# usage batch holds up to GatewaySettings.usage_max_rows rows of ~200 bytes.
DEFAULT_LIMITS: tuple[tuple[str, int], ...] = (
    ("/agent/v1/register", 1 * MiB),
    ("/agent/", 8 * MiB),
    ("/gateway/v1/usage", 48 * MiB),
    ("/gateway/", 8 * MiB),
    ("/", 8 * MiB),
)
BODY_IDLE_S = 30.0
BODY_TOTAL_S = 120.0


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        limits: Sequence[tuple[str, int]] = DEFAULT_LIMITS,
        idle_s: float = BODY_IDLE_S,
        total_s: float = BODY_TOTAL_S,
    ) -> None:
        self.app = app
        self.limits = sorted(limits, key=lambda item: -len(item[0]))
        self.idle_s = idle_s
        self.total_s = total_s

    def limit_for(self, path: str) -> int:
        return next((size for prefix, size in self.limits if path.startswith(prefix)),
                    self.limits[-1][1])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(send, 413, f"request body of {declared} bytes is over this route's"
                          f" limit of {limit} bytes")
            return
        received = 0
        started = refused = False
        deadline: float | None = None  # set at the first receive

        async def refuse(status: int, message: str) -> Message:
            # Answered here, at once; the route then sees the client gone
            # (what it would see if the client had hung up) and anything it
            # still tries to send is dropped.
            nonlocal refused, started
            if not started:
                started = refused = True
                await _refuse(send, status, message)
            return {"type": "http.disconnect"}

        async def counted_receive() -> Message:
            nonlocal received, deadline
            if refused:
                return {"type": "http.disconnect"}
            now = asyncio.get_running_loop().time()
            if deadline is None:
                deadline = now + self.total_s
            idle_until = now + self.idle_s
            try:
                # asyncio.timeout, not 3.11's wait_for, which can swallow the
                # cancel of a request whose client left (services/gateways.py).
                async with asyncio.timeout_at(min(deadline, idle_until)):
                    message = await receive()
            except TimeoutError:
                if idle_until <= deadline:
                    return await refuse(
                        408, f"no part of the request body arrived for {self.idle_s:g} s")
                return await refuse(
                    408, f"the request body was not complete within {self.total_s:g} s")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    return await refuse(
                        413, f"request body is over this route's limit of {limit} bytes")
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except Exception:
            if not refused:
                raise


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def refusal_body(status: int, message: str) -> bytes:
    kind = "request_too_large" if status == 413 else "request_timeout"
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "code": kind}})


async def _refuse(send: Send, status: int, message: str) -> None:
    body = refusal_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
