"""An llmgw app under uvicorn's own protocol (llmgw.http.asgi): the same contract as on llmgw's.

An app answers through a Reply and reads the header index wherever it runs;
under any other server, as_asgi makes both from ASGI's send and scope. Each
test runs the app under uvicorn's httptools protocol (what tests serve the
gateway with) and checks what a client sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
from tests.servers import serve_asgi

from llmgw.http.asgi import WATCH_AFTER_S, as_asgi
from llmgw.http.contract import Endpoint, Receive, Reply, Scope, request_headers


class _App:
    """Answers per path through the Reply's own calls, never ASGI messages."""

    endpoints: Mapping[tuple[str, str], Endpoint] = {}

    def __init__(self) -> None:
        self.ended: asyncio.Future[bool] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
        path = scope["path"]
        if path == "/whole":
            seen = request_headers(scope).get(b"x-twice", b"-")
            await send.answer(201, [(b"content-type", b"text/plain")], b"first " + seen)
        elif path == "/stream":
            send.start(200, [(b"content-type", b"text/event-stream")])
            await send.stream(b"data: 1\n\n")
            await send.stream(b"data: 2\n\n", False)
        elif path == "/slow":
            await receive()
            self.ended = asyncio.get_running_loop().create_future()
            send.cancel_if_gone()
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.ended.set_result(send.disconnected)
                raise


async def test_a_whole_answer_and_the_first_of_a_repeated_header() -> None:
    async with serve_asgi(as_asgi(_App()), http="httptools") as url, httpx.AsyncClient() as client:
        answer = await client.get(url + "/whole", headers=[("X-Twice", "a"), ("X-Twice", "b")])
    assert answer.status_code == 201
    assert answer.text == "first a"
    assert answer.headers["content-length"] == "7"
    assert answer.headers["content-type"] == "text/plain"


async def test_a_stream_begun_with_start_arrives_chunked_and_whole() -> None:
    async with serve_asgi(as_asgi(_App()), http="httptools") as url, httpx.AsyncClient() as client:
        answer = await client.get(url + "/stream")
    assert answer.status_code == 200
    assert answer.headers["transfer-encoding"] == "chunked"
    assert answer.text == "data: 1\n\ndata: 2\n\n"


async def test_a_client_that_leaves_cancels_a_request_that_asked() -> None:
    app = _App()
    async with serve_asgi(as_asgi(app), http="httptools") as url:
        port = int(url.rsplit(":", 1)[1])
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        for _ in range(100):
            if app.ended is not None:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(WATCH_AFTER_S * 2)  # the watcher is started by now
        writer.close()
        assert app.ended is not None
        # Cancelled as soon as the server reports the disconnect, long before
        # the app's own five seconds, and it knows why.
        assert await asyncio.wait_for(app.ended, 2) is True


async def test_the_lifespan_reaches_the_app_with_a_reply_that_sends() -> None:
    sent: list[Any] = []

    class Lifespan:
        endpoints: Mapping[tuple[str, str], Endpoint] = {}

        async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        sent.append(message)

    await as_asgi(Lifespan())({"type": "lifespan"}, receive, send)
    assert sent == [{"type": "lifespan.startup.complete"}]
