"""Servers the fuzz targets talk to: llmgw's own HTTP server in a thread, raw socket upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import uvicorn

from llmgw.http.server import Plain, server_config
from llmgw.serving import start_server


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """What the server read: method, path, the body's length and digest, one header."""
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    probe = dict(scope["headers"]).get(b"x-probe", b"").decode("latin-1")
    answer = orjson.dumps({"m": scope["method"], "p": scope["path"], "n": len(body),
                           "h": hashlib.sha256(body).hexdigest()[:16], "x": probe})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@contextlib.contextmanager
def threaded_server(app: Any, **settings: Any) -> Iterator[tuple[str, int]]:
    """``app`` on llmgw's HTTP server (llmgw.http.server) on 127.0.0.1, in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    server = uvicorn.Server(server_config(Plain(app), log_level="critical", **settings))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    ready = threading.Event()
    task: list[asyncio.Task[None]] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            task.append(await start_server(server, sockets=[sock]))
            ready.set()
            await task[0]

        loop.run_until_complete(main())

    thread = threading.Thread(target=serve, name="fuzz-server", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fuzz server did not start")
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(10)
        loop.close()
        sock.close()


def exchange_raw(host: str, port: int, data: bytes, timeout_s: float,
                 half_close: bool = False) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; (what came back, whether the server closed it).

    Reads until the server closes or ``timeout_s`` passes in silence.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close before taking everything (a 400)
        received = bytearray()
        while True:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                return bytes(received), False
            except OSError:
                return bytes(received), True
            if not piece:
                return bytes(received), True
            received += piece


class RawUpstream:
    """A TCP server answering each connection with what ``answer`` says, for client fuzzing.

    ``answer(request_bytes)`` returns the bytes to send and whether to close
    after them (False: keep the connection open, silent, as a stalled upstream).
    """

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.answer: Callable[[], list[bytes]] = lambda: []
        self.close_after = True
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="fuzz-upstream", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        pieces, close_after = self.answer(), self.close_after
        with conn:
            conn.settimeout(2.0)
            try:
                conn.recv(65536)
                for piece in pieces:
                    conn.sendall(piece)
                if not close_after:
                    conn.recv(1)  # held open until the client gives up
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
