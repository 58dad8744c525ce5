"""Engine dialects mended by the gateway, and streams that end before they finish.

The simulated engine plays an engine with llama_cpp.server's dialect (it
ignores ``max_completion_tokens`` and ``stream_options``, and tokenizes on
``/tokenize``); the official ``openai`` client is the client. The sim's
tokenizer is a documented rule (4 bytes a token), so exact counts are known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from tests.gateway.conftest import async_client, make_config, route, running_gateway
from tests.gateway.sims import LLAMA_DIALECT, metered, running_sim
from tests.waiting import eventually

from llmgw import wire
from llmgw.gateway.dialect import LEGACY, mend_request, mending_for
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.routes.sse import StreamRelay
from llmgw.sim.engine import SimEngine

# What the llama.cpp adapter declares for llama_cpp.server, on the sim's routes.
IGNORANT = LLAMA_DIALECT
MESSAGES = [{"role": "user", "content": "Count the blocks of the prefix cache, please."}]


@pytest.fixture
async def ignorant_sim() -> AsyncIterator[SimEngine]:
    async with running_sim() as engine:
        yield engine


def _sim_route(engine: SimEngine, dialect: wire.EngineDialect | None) -> wire.ModelRoute:
    endpoint = wire.Endpoint(replica_id="sim-1", url=engine.url, dialect=dialect)
    return wire.ModelRoute(name="m", served_name="sim", endpoints=[endpoint])


# -- compiled once per endpoint -------------------------------------------------


def test_mendings_are_compiled_once_per_dialect() -> None:
    assert mending_for(None) is LEGACY
    first = mending_for(IGNORANT)
    assert first is mending_for(IGNORANT.model_copy())
    assert first.rename_max_completion_tokens and first.count_streams
    faithful = mending_for(wire.EngineDialect())
    assert not faithful.rename_max_completion_tokens and not faithful.count_streams
    # No tokenizer: nothing to count with, so no usage is made up.
    blind = mending_for(wire.EngineDialect(stream_usage=False))
    assert not blind.count_streams


def test_max_completion_tokens_becomes_max_tokens_where_ignored() -> None:
    ignorant, faithful = mending_for(IGNORANT), mending_for(wire.EngineDialect())
    chat = "/v1/chat/completions"
    payload: dict[str, Any] = {"max_completion_tokens": 5}
    assert mend_request(chat, payload, ignorant) and payload == {"max_tokens": 5}
    payload = {"max_completion_tokens": 5, "max_tokens": 9}
    assert mend_request(chat, payload, ignorant) and payload == {"max_tokens": 5}
    payload = {"max_completion_tokens": 9, "max_tokens": 5}
    assert mend_request(chat, payload, ignorant) and payload == {"max_tokens": 5}
    payload = {"max_completion_tokens": 5}
    assert not mend_request(chat, payload, faithful) and payload == {"max_completion_tokens": 5}
    # OpenAI's legacy completions only know max_tokens: mended for every engine.
    payload = {"max_completion_tokens": 5}
    assert mend_request("/v1/completions", payload, faithful) and payload == {"max_tokens": 5}
    assert not mend_request(chat, {"max_tokens": 5}, ignorant)


def _event(finish: str | None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return b'data: {"id":"c","choices":[{"index":0,"finish_reason":' + reason.encode() + b"}]}\n\n"


def test_a_stream_is_whole_only_with_a_finish_reason_then_done() -> None:
    relay = StreamRelay(strip_usage=False)
    out = relay.feed(_event(None) + _event("stop") + b"data: [DONE]\n\n")
    assert relay.whole and out.endswith(b"data: [DONE]\n\n")
    # llama_cpp.server's interrupted stream: [DONE] with no finish reason is not passed on.
    relay = StreamRelay(strip_usage=False)
    out = relay.feed(_event(None) + b"data: [DONE]\n\n")
    assert relay.done and not relay.finished and not relay.whole
    assert b"[DONE]" not in out and out == _event(None)
    # A finish reason with no [DONE] after it is not whole either.
    relay = StreamRelay(strip_usage=False)
    relay.feed(_event("length"))
    assert relay.finished and not relay.whole
    # hold_done: the caller sends [DONE] itself, after what it adds.
    seen: list[bytes] = []
    relay = StreamRelay(strip_usage=False, hold_done=True, observe=seen.append)
    out = relay.feed(_event("stop") + b"data: [DONE]\n\n")
    assert relay.whole and b"[DONE]" not in out and seen


# -- against an engine ---------------------------------------------------------


async def _stream(client: openai.AsyncOpenAI, **options: Any) -> list[Any]:
    stream = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        temperature=0,
        **options,  # type: ignore[arg-type]
    )
    return [chunk async for chunk in stream]


async def test_counted_stream_usage_equals_the_unstreamed_answer(ignorant_sim: SimEngine) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_sim_route(ignorant_sim, IGNORANT)]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        whole = await client.chat.completions.create(
            model="m", messages=MESSAGES, temperature=0, max_tokens=7
        )
        assert whole.usage is not None
        chunks = await _stream(client, max_tokens=7, stream_options={"include_usage": True})
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and chunks[-1] is with_usage[0]
        usage = with_usage[0].usage
        assert with_usage[0].choices == []
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens
        ) == (usage.prompt_tokens, 7)  # fmt: skip
        assert usage.total_tokens == usage.prompt_tokens + 7
        for chunk in chunks:
            assert chunk.id and chunk.created and chunk.model == "sim"
            assert chunk.object == "chat.completion.chunk"
        # A client that did not ask gets no usage chunk, and is metered exactly.
        chunks = await _stream(client, max_tokens=3)
        assert all(c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        # Completions: the prompt is tokenized, as the engine does.
        completion = await client.completions.create(
            model="m", prompt="twelve bytes", max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        last = [c async for c in completion][-1]
        assert last.usage is not None and last.choices == []
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 2)
        expected = (
            2 * whole.usage.prompt_tokens + usage.prompt_tokens + 3,  # three chats, one prompt
            7 + 7 + 3 + 2,
        )
        await eventually(lambda: metered(link) == expected, 5, what=f"{expected} metered",
                         note=lambda: metered(link))  # fmt: skip


async def test_max_completion_tokens_is_honoured_where_the_engine_ignores_it(
    ignorant_sim: SimEngine,
) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_sim_route(ignorant_sim, IGNORANT)]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        reply = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_completion_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        chunks = await _stream(client, max_completion_tokens=4)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 4
    # Without the dialect (an older agent) the engine's default of 16 wins.
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_sim_route(ignorant_sim, None)]))
    async with running_gateway(link) as (_, url):
        reply = await async_client(url).chat.completions.create(
            model="m", messages=MESSAGES, max_completion_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 16


@pytest.mark.parametrize("options", [{"cut_stream_after": 2}, {"send_done": False}])
async def test_a_stream_that_ends_unfinished_is_an_error(
    upstreams: Any, link: MemoryLink, options: dict[str, Any]
) -> None:
    engine = await upstreams("cut", tokens=5, **options)
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        received: list[str] = []
        with pytest.raises(openai.APIError) as failed:
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)
        assert "before finishing" in failed.value.message
        assert received  # the part that came was relayed, then the error
    assert gateway.runtime.metrics is not None


async def test_a_sim_stream_cut_short_is_an_error_and_metered(link: MemoryLink) -> None:
    params = wire.SimParams(startup_s=0.0, decode_ms_per_token=0.2, fault="cut_stream",
                            crash_after_tokens=3, stream_usage=False)  # fmt: skip
    async with running_sim(params) as engine:
        link.publish(make_config(1, [_sim_route(engine, IGNORANT)]))
        async with running_gateway(link) as (_, url):
            with pytest.raises(openai.APIError, match="before finishing"):
                await _stream(async_client(url), max_tokens=10)
            # The three tokens the client received are metered (an error row).
            await eventually(lambda: metered(link)[1] == 3, 5, what="3 tokens metered")
            assert metered(link)[1] == 3
            assert sum(r.errors for r in link.usage) == 1
