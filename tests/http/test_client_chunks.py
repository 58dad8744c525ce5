"""The engine client (llmgw.http.client) hands over the chunks of a read together.

httptools reports each HTTP chunk of an answer on its own; the connection
gives them to the answer once per read. What a relay takes out must still be
every byte in order, the end seen, and a malformed answer fail only after
what arrived before it was taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from llmgw.http.client import Pool, render_post, request_head
from llmgw.http.upstream import BodyBroken

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@asynccontextmanager
async def engine(writes: list[bytes]) -> AsyncIterator[int]:
    """An engine answering any request with ``writes``, one write each, 50 ms apart."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for data in writes:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.05)
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def _chunks(writes: list[bytes]) -> tuple[list[bytes], Exception | None]:
    async with engine(writes) as port:
        pool = Pool(2.0, 10.0)
        payload = render_post(request_head("127.0.0.1", port, "/v1/x"), b"{}", b"")
        taken: list[bytes] = []
        failure: Exception | None = None
        try:
            response = await pool.request("127.0.0.1", port, payload)
            try:
                while (piece := await asyncio.wait_for(response.next_chunk(), 5)) is not None:
                    taken.append(piece)
                assert response.drained
            except BodyBroken as exc:
                failure = exc
            response.release()
        finally:
            pool.close()
        return taken, failure


async def test_the_chunks_of_one_read_come_out_as_one() -> None:
    writes = [
        HEAD + chunk(b"a") + chunk(b"b") + chunk(b"c"),
        chunk(b"d") + chunk(b"e") + b"0\r\n\r\n",
    ]
    taken, failure = await _chunks(writes)
    assert failure is None
    assert taken == [b"abc", b"de"]


async def test_a_malformed_chunk_fails_after_what_came_before_it() -> None:
    taken, failure = await _chunks([HEAD + chunk(b"a") + chunk(b"b") + b"zz\r\nnot a chunk\r\n"])
    assert taken == [b"ab"]
    assert isinstance(failure, BodyBroken) and "malformed" in str(failure)


@pytest.mark.parametrize("split", [30, 120, 135, 10_000])
async def test_a_whole_answer_read_in_two_pieces_is_the_same(split: int) -> None:
    # Cut in the head, in a chunk's size line, in its data, or not at all.
    data = HEAD + b"".join(chunk(b"%d," % i) for i in range(30)) + b"0\r\n\r\n"
    async with engine([data[:split], data[split:]]) as port:
        pool = Pool(2.0, 10.0)
        payload = render_post(request_head("127.0.0.1", port, "/v1/x"), b"{}", b"")
        try:
            response = await pool.request("127.0.0.1", port, payload)
            body = await asyncio.wait_for(response.read(), 5)
            response.release()
        finally:
            pool.close()
    assert body == b"".join(b"%d," % i for i in range(30))


async def test_each_answer_has_its_own_content_type_however_the_engine_spells_it() -> None:
    # Three answers on one keep-alive connection: the headers of one must not
    # stand for the next (the connection keeps one table of them).
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nContent-Length: 1\r\n\r\na",
        b"HTTP/1.1 200 OK\r\nCONTENT-TYPE: text/plain\r\nContent-Length: 1\r\n\r\nb",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nc",
    ]
    peers: list[object] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername"))
        for data in answers:
            await reader.readuntil(b"\r\n\r\n{}")
            writer.write(data)
            await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(2.0, 10.0)
    payload = render_post(request_head("127.0.0.1", port, "/v1/x"), b"{}", b"")
    seen = []
    try:
        for _ in answers:
            response = await asyncio.wait_for(pool.request("127.0.0.1", port, payload), 5)
            seen.append((response.content_type, await asyncio.wait_for(response.read(), 5)))
            response.release()
    finally:
        pool.close()
        server.close()
    assert seen == [(b"text/event-stream", b"a"), (b"text/plain", b"b"), (None, b"c")]
    assert len(peers) == 1
