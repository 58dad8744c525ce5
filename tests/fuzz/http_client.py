"""The gateway's HTTP client (llmgw.http.client) against hostile upstreams.

Each case is an answer an upstream might send: valid ones in every framing,
broken chunking, huge or endless heads, bodies cut short, closes before a
byte, bytes after the answer, 1xx heads. The property: the client gives a
whole answer exactly as sent (when it is valid), or one of its own
failures (ConnectFailed, BodyBroken, UpstreamTimeout); never another
exception, never a wait past the request's deadline, and never more than
its caps in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from tests.fuzz.runner import Failure, Hang, Target
from tests.fuzz.servers import RawUpstream

from llmgw.http.client import Pool, render_post, request_head
from llmgw.http.upstream import BodyBroken, ConnectFailed, UpstreamTimeout

DEADLINE_S = 2.0
MAX_ANSWER = 1 << 20


@dataclass(frozen=True)
class Answer:
    pieces: tuple[bytes, ...]
    close_after: bool
    # The body the client must return when the answer is valid (None: no promise).
    body: bytes | None
    stream: bool
    # A head past any sane size: refused at once, not after the deadline.
    oversized: bool = False


def _chunked(body: bytes, size: int) -> bytes:
    out = b""
    for at in range(0, len(body), max(1, size)):
        piece = body[at:at + max(1, size)]
        out += b"%x\r\n%b\r\n" % (len(piece), piece)
    return out + b"0\r\n\r\n"


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    body = draw(st.binary(max_size=300))
    stream = draw(st.booleans())
    status = draw(st.sampled_from([200, 200, 201, 400, 404, 429, 500, 503]))
    kind = draw(st.sampled_from([
        "length", "chunked", "length_close", "early_close", "cut_head", "no_head",
        "bad_chunk", "endless_head", "huge_header", "many_headers", "stall", "extra_bytes",
        "continue", "garbage", "negative_length", "two_lengths", "cl_te", "short_chunk",
    ]))
    head = b"HTTP/1.1 %d X\r\nContent-Type: text/event-stream\r\n" % status
    if kind == "length":
        return Answer((head + b"Content-Length: %d\r\n\r\n" % len(body) + body,), True, body,
                      stream)
    if kind == "chunked":
        size = draw(st.integers(1, 64))
        data = head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body, size)
        cut = draw(st.integers(0, len(data)))
        return Answer((data[:cut], data[cut:]), True, body, stream)
    if kind == "length_close":
        return Answer((head + b"Connection: close\r\n\r\n" + body,), True, None, stream)
    if kind == "early_close":
        data = head + b"Content-Length: %d\r\n\r\n" % (len(body) + 10) + body
        return Answer((data,), True, None, stream)
    if kind == "cut_head":
        data = head + b"Content-Length: 5\r\n\r\nhello"
        return Answer((data[:draw(st.integers(0, len(data) - 6))],), True, None, stream)
    if kind == "no_head":
        return Answer((), True, None, stream)
    if kind == "bad_chunk":
        bad = draw(st.sampled_from([b"zz\r\n", b"-1\r\n", b"ffffffffffffffffffff\r\n",
                                    b"5\r\nabc\r\n", b"3\r\nabcde\r\n0\r\n\r\n"]))
        return Answer((head + b"Transfer-Encoding: chunked\r\n\r\n" + bad,), True, None, stream)
    if kind == "endless_head":
        return Answer((head, *[b"X-Fill-%d: %s\r\n" % (i, b"v" * 1000) for i in range(300)]),
                      False, None, stream, oversized=True)
    if kind == "huge_header":
        return Answer((head + b"X-Big: " + b"b" * 400_000 + b"\r\n",), False, None, stream,
                      oversized=True)
    if kind == "many_headers":
        many = b"".join(b"X-H%d: 1\r\n" % i for i in range(draw(st.integers(100, 3000))))
        return Answer((head + many + b"Content-Length: 0\r\n\r\n",), True, b"", stream)
    if kind == "stall":
        data = head + b"Content-Length: %d\r\n\r\n" % (len(body) + 1) + body
        return Answer((data,), False, None, stream)
    if kind == "extra_bytes":
        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body + b"HTTP/1.1 200 OK\r\n"
        return Answer((data,), True, body, stream)
    if kind == "continue":
        data = (b"HTTP/1.1 100 Continue\r\n\r\n" + head + b"Content-Length: %d\r\n\r\n"
                % len(body) + body)
        return Answer((data,), True, None, stream)
    if kind == "negative_length":
        return Answer((head + b"Content-Length: -5\r\n\r\n" + body,), True, None, stream)
    if kind == "two_lengths":
        return Answer((head + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",), True, None,
                      stream)
    if kind == "cl_te":
        data = (head + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunked(body, 8))
        return Answer((data,), True, None, stream)
    if kind == "short_chunk":
        data = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"a\r\nabc"
        return Answer((data,), True, None, stream)
    return Answer((draw(st.binary(min_size=1, max_size=200)),), True, None, stream)


class _Client:
    """A loop in a thread of its own with a Pool, and a hostile upstream."""

    def __init__(self) -> None:
        self.upstream = RawUpstream()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = Pool(1.0, DEADLINE_S, max_answer_bytes=MAX_ANSWER)

    def close(self) -> None:
        async def closed() -> None:
            self.pool.close()
            await asyncio.sleep(0.01)  # the sweeper's cancel runs before the loop stops

        asyncio.run_coroutine_threadsafe(closed(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.upstream.close()


def _setup() -> contextlib.closing[_Client]:
    return contextlib.closing(_Client())


async def _ask(pool: Pool, port: int, stream: bool) -> tuple[int, bytes]:
    payload = render_post(request_head("127.0.0.1", port, "/v1/x"), b"{}", b"")
    response = await pool.request("127.0.0.1", port, payload)
    try:
        if not stream:
            return response.status, await response.read()
        parts = []
        while (chunk := await response.next_chunk()) is not None:
            parts.append(chunk)
        return response.status, b"".join(parts)
    finally:
        response.release()


def check(client: _Client, answer: Answer) -> None:
    client.upstream.answer = lambda: list(answer.pieces)
    client.upstream.close_after = answer.close_after
    started = time.monotonic()
    future = asyncio.run_coroutine_threadsafe(
        _ask(client.pool, client.upstream.port, answer.stream), client.loop)
    # The deadline is enforced by a sweep once a second: up to a second late.
    limit = DEADLINE_S + 1.0 + 1.5
    try:
        got: Any = future.result(limit)
    except (ConnectFailed, BodyBroken, UpstreamTimeout) as exc:
        if answer.body is not None:
            raise Failure(f"a valid answer refused: {exc!r}") from None
        if answer.oversized and isinstance(exc, UpstreamTimeout):
            raise Failure("an oversized head was read until the deadline, not refused") from None
        return
    except TimeoutError:
        future.cancel()
        raise Hang(f"no result or failure within {limit} s") from None
    took = time.monotonic() - started
    status, body = got
    if status < 200:
        raise Failure(f"an interim {status} answer handed over as the answer")
    if answer.body is not None and body != answer.body:
        raise Failure(f"answer read as {body[:100]!r}, sent {answer.body[:100]!r}")
    if took > limit:
        raise Hang(f"took {took:.1f} s")


TARGET = Target("http_client_hostile_upstream", _setup, lambda _: answers(), check)
