"""Non-streamed answers over the relay's high-water mark (issue 13).

A non-streamed answer over 1 MiB used to stall: the connection to the engine
stopped being read at the high-water mark and nothing resumed it, so the
client waited for the 900 s upstream deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from tests.gateway.conftest import async_client, make_config, route, running_gateway
from tests.gateway.sims import stub_engine

from llmgw.gateway.link import MemoryLink
from llmgw.http.client import Pool, render_post, request_head
from llmgw.http.upstream import AnswerTooLarge

MiB = 1024 * 1024


@pytest.fixture
async def big_engine() -> AsyncIterator[str]:
    """An engine whose chat answer carries 3 MiB of content."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "big", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "x" * (3 * MiB)}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
        })

    async with stub_engine("/v1/chat/completions", chat) as url:
        yield url


async def test_a_3_mib_answer_arrives_in_full_at_once(big_engine: str, link: MemoryLink) -> None:
    link.publish(make_config(1, [route("big", [big_engine])]))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=10.0)
        started = time.monotonic()
        answer = await client.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "hi"}])
        took = time.monotonic() - started
    assert answer.choices[0].message.content == "x" * (3 * MiB)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert took < 5.0


async def test_an_answer_over_the_cap_is_refused_not_buffered(big_engine: str) -> None:
    pool = Pool(2.0, 10.0, max_answer_bytes=2 * MiB)
    host, port = "127.0.0.1", int(big_engine.rsplit(":", 1)[1])
    body = b'{"model": "big", "messages": []}'
    payload = render_post(request_head(host, port, "/v1/chat/completions"), body, b"")
    try:
        response = await pool.request(host, port, payload)
        with pytest.raises(AnswerTooLarge, match="over 2097152 bytes"):
            await asyncio.wait_for(response.read(), 5.0)
        response.release()
        # The pool keeps working for the next answer (under the cap).
        pool.max_answer_bytes = 8 * MiB
        again = await pool.request(host, port, payload)
        data: Any = await asyncio.wait_for(again.read(), 5.0)
        again.release()
        assert len(data) > 3 * MiB
    finally:
        pool.close()
