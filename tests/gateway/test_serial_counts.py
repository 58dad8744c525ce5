"""Counting streams on an engine that computes one request at a time, after its clients.

llama_cpp.server reports no usage in a stream, so the gateway counts a
stream with the engine's tokenize route; that engine takes every request
under one lock, so a count sent beside the gateway's turns went before the
next client's prompt. Where nobody waits for the count (the client did not
ask for usage), it takes the last turn: a client's request queued meanwhile
reaches the engine first, and the stream is still metered exactly. The sim
plays the engine (4 bytes a token), the official ``openai`` client the
clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import openai
from aiohttp import web
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.sims import LLAMA_DIALECT, metered
from tests.waiting import eventually

from llmgw import wire
from llmgw.gateway.link import MemoryLink
from llmgw.sim.engine import SimEngine

SERIAL = LLAMA_DIALECT.model_copy(update={"concurrent": False})
PARAMS = wire.SimParams(startup_s=0.0, decode_ms_per_token=20.0, prefill_tokens_per_s=1e6,
                        max_completion_tokens=False, stream_usage=False)  # fmt: skip
MESSAGES = [{"role": "user", "content": "Which tenant holds the prefix cache now?"}]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serial_gateway() -> AsyncIterator[tuple[list[str], MemoryLink, openai.AsyncOpenAI]]:
    """A gateway before a sim routed as one-request-at-a-time: (the requests the sim
    received in order, the gateway's link, a client). A client's stream arrives as
    "chat"; the gateway's counts (its tokenize route, and the one-token copy that
    counts a chat prompt where no template is declared) as "count"."""
    arrivals: list[str] = []
    engine = SimEngine("sim", PARAMS)

    def noted(handler: Handler) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json() if request.path.endswith("/completions") else {}
            arrivals.append("chat" if body.get("stream") else "count")
            return await handler(request)

        return handle

    engine._chat = noted(engine._chat)  # type: ignore[method-assign]
    engine._tokenize = noted(engine._tokenize)  # type: ignore[method-assign]
    await engine.start("127.0.0.1", 0)
    assert await engine.wait_ready()
    try:
        link = MemoryLink(poll_timeout_s=1.0)
        endpoint = wire.Endpoint(replica_id="sim-1", url=engine.url, dialect=SERIAL)
        link.publish(make_config(1, [wire.ModelRoute(name="m", served_name="sim",
                                                     endpoints=[endpoint])]))  # fmt: skip
        async with running_gateway(link) as (_, url):
            yield arrivals, link, async_client(url)
    finally:
        await engine.stop()


async def _chat(client: openai.AsyncOpenAI, tokens: int) -> int:
    stream = await client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, max_tokens=tokens, temperature=0
    )
    return len([chunk async for chunk in stream])


async def test_a_waiting_client_goes_before_the_counts_of_the_stream_before_it() -> None:
    async with serial_gateway() as (arrivals, link, client):
        first = asyncio.create_task(_chat(client, 10))  # ~200 ms at the engine
        await eventually(lambda: "chat" in arrivals, 5, what="the first chat sent")
        second = asyncio.create_task(_chat(client, 2))  # waits for its turn
        await asyncio.gather(first, second)
        # Each stream is counted (its prompt, its completion, and once the
        # tokenizer's empty text): none of it before the second chat.
        await eventually(lambda: metered(link)[1] == 12, 5, what="both streams metered",
                         note=lambda: metered(link))  # fmt: skip
        assert arrivals[:2] == ["chat", "chat"], arrivals
        assert set(arrivals[2:]) == {"count"}


async def test_a_client_that_waits_for_usage_has_its_prompt_counted_during_its_stream() -> None:
    async with serial_gateway() as (arrivals, _, client):
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, max_tokens=3, temperature=0,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 3 and usage.prompt_tokens
        assert arrivals[0] == "chat" and arrivals.count("count") >= 2
