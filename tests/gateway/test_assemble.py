"""Unstreamed answers assembled from a stream, for engines that only stop a stream.

An engine whose dialect says it finishes a non-streamed request for a client
who has left (llama_cpp.server) is asked for a stream; the client still gets
OpenAI's unstreamed answer. The real engine is in
test_dialect_real_engine.py; here the simulator (exact token counts) and the
fake engine (which records what it was sent) play it, with the official
``openai`` client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.sims import LLAMA_DIALECT, counts, running_sim
from tests.waiting import eventually

from llmgw import wire
from llmgw.gateway.dialect import mending_for
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.metering import counter
from llmgw.gateway.metering.tally import StreamTally
from llmgw.gateway.routes.assemble import Assembler
from llmgw.sim.engine import SimEngine

# llama_cpp.server's dialect, on the sim's tokenizer route.
UNSTOPPING = LLAMA_DIALECT.model_copy(update={"stops_unstreamed": False})
STOPPING = UNSTOPPING.model_copy(update={"stops_unstreamed": True})
# An engine that reports usage in streams but finishes what it was asked unstreamed.
REPORTING = wire.EngineDialect(stops_unstreamed=False)
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me about the prefix cache of this engine."}
]


def _events(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_mending_assembles_only_where_the_engine_cannot_stop_and_usage_is_known() -> None:
    assert mending_for(UNSTOPPING).assemble_unstreamed
    assert not mending_for(STOPPING).assemble_unstreamed
    assert not mending_for(wire.EngineDialect()).assemble_unstreamed
    reports = mending_for(REPORTING)
    assert reports.assemble_unstreamed and reports.reports_stream_usage
    # Neither stream usage nor a tokenizer: an answer without usage would be
    # worse than an engine that runs on, so it is not streamed.
    blind = wire.EngineDialect(stream_usage=False, stops_unstreamed=False)
    assert not mending_for(blind).assemble_unstreamed


def test_chat_chunks_become_one_message_with_tool_calls_and_logprobs() -> None:
    head = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m", "system_fingerprint": "fp"}  # fmt: skip
    tokens = [{"token": "Hi", "logprob": -0.1, "bytes": None, "top_logprobs": []},
              {"token": "!", "logprob": -0.2, "bytes": None, "top_logprobs": []}]  # fmt: skip
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    stream = _events(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                              "logprobs": {"content": tokens[:1], "refusal": None},
                              "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "!"},
                              "logprobs": {"content": tokens[1:], "refusal": None},
                              "finish_reason": None},
                             {"index": 1, "delta": {"role": "assistant", "tool_calls": [call]},
                              "finish_reason": None}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"city": '}}]}, "finish_reason": None}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"},
                             {"index": 1, "delta": {}, "finish_reason": "tool_calls"}]},
    )  # fmt: skip
    assembler = Assembler(chat=True)
    assembler.add(stream)
    assert assembler.finished
    usage = {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}
    answer = orjson.loads(assembler.answer(usage))
    assert answer == {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": "fp",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi!"},
             "logprobs": {"content": tokens, "refusal": None}, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             "logprobs": None, "finish_reason": "tool_calls"},
        ],
        "usage": usage,
    }  # fmt: skip
    # What the gateway counts when the engine reports no usage: the texts.
    assert assembler.tally.completions() == ["Hi!", 'get_weather{"city": "Oslo"}']


def test_completion_chunks_become_one_text_with_its_logprobs() -> None:
    head = {"id": "cmpl-3", "object": "text_completion", "created": 5, "model": "m"}
    stream = _events(
        {**head, "choices": [{"index": 0, "text": " red", "finish_reason": None,
                              "logprobs": {"tokens": [" red"], "token_logprobs": [-0.5],
                                           "top_logprobs": [{" red": -0.5}],
                                           "text_offset": [10]}}]},
        {**head, "choices": [{"index": 0, "text": ",", "finish_reason": "length",
                              "logprobs": {"tokens": [","], "token_logprobs": [-0.1],
                                           "top_logprobs": [{",": -0.1}],
                                           "text_offset": [14]}}]},
    )  # fmt: skip
    assembler = Assembler(chat=False)
    # Split mid-event, as bytes arrive: the relay hands over whole events only,
    # but the assembler must not care how blocks are cut between events.
    for event in stream.split(b"\n\n"):
        assembler.add(event + b"\n\n")
    answer = orjson.loads(assembler.answer(None))
    assert answer["object"] == "text_completion" and answer["usage"] is None
    assert answer["choices"] == [{
        "index": 0, "text": " red,", "finish_reason": "length",
        "logprobs": {"tokens": [" red", ","], "token_logprobs": [-0.5, -0.1],
                     "top_logprobs": [{" red": -0.5}, {",": -0.1}], "text_offset": [10, 14]},
    }]  # fmt: skip
    # A stream with a choice left unfinished, or none at all, is not an answer.
    unfinished = Assembler(chat=False)
    unfinished.add(_events({**head, "choices": [{"index": 0, "text": "x", "finish_reason": None}]}))
    assert not unfinished.finished and not Assembler(chat=False).finished


@pytest.fixture
async def unstopping_sim() -> AsyncIterator[SimEngine]:
    async with running_sim() as engine:
        yield engine


def _route(url: str, dialect: wire.EngineDialect, name: str = "m") -> wire.ModelRoute:
    endpoint = wire.Endpoint(replica_id=f"{name}-1", url=url, dialect=dialect)
    return wire.ModelRoute(name=name, served_name="sim", endpoints=[endpoint])


async def test_an_assembled_answer_equals_the_engines_own_unstreamed_one(
    unstopping_sim: SimEngine,
) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_route(unstopping_sim.url, UNSTOPPING),
                                 _route(unstopping_sim.url, STOPPING, "direct")]))  # fmt: skip
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        for ask in (
            {"messages": MESSAGES, "temperature": 0, "max_tokens": 7},
            {"messages": MESSAGES, "temperature": 0, "max_completion_tokens": 300},
        ):
            built = await client.chat.completions.create(model="m", **ask)  # type: ignore[call-overload]
            direct = await client.chat.completions.create(model="direct", **ask)  # type: ignore[call-overload]
            assert built.object == "chat.completion" and built.id and built.created
            assert built.model == direct.model == "sim"
            assert built.choices[0].message.content == direct.choices[0].message.content
            assert built.choices[0].message.role == "assistant"
            assert built.choices[0].finish_reason == direct.choices[0].finish_reason
            assert counts(built.usage) == counts(direct.usage)
        built_text = await client.completions.create(model="m", prompt="twelve bytes",
                                                     max_tokens=5, temperature=0)  # fmt: skip
        direct_text = await client.completions.create(model="direct", prompt="twelve bytes",
                                                      max_tokens=5, temperature=0)  # fmt: skip
        assert built_text.object == "text_completion"
        assert built_text.choices[0].text == direct_text.choices[0].text
        assert built_text.choices[0].finish_reason == direct_text.choices[0].finish_reason
        assert counts(built_text.usage)[:2] == counts(direct_text.usage)[:2]


async def _reporting(upstreams: Any, link: MemoryLink, name: str, **behaviour: Any) -> Any:
    """A fake engine of the REPORTING dialect, published as model ``m``."""
    engine = await upstreams(name, **behaviour)
    link.publish(make_config(1, [_route(engine.url, REPORTING)]))
    return engine


async def test_an_engine_reporting_stream_usage_is_asked_for_it_and_it_is_kept(
    upstreams: Any, link: MemoryLink,
) -> None:
    engine = await _reporting(upstreams, link, "e1", tokens=4)
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        answer = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert answer.choices[0].message.content == "hello from e1 t1 t2 t3"
        assert answer.choices[0].finish_reason == "stop"
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        details = answer.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == 2  # the engine's own object
        sent = engine.seen[-1].body
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        # A stream the client asked for is relayed as ever.
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True)]  # fmt: skip
        assert chunks[-1].choices[0].finish_reason == "stop"
    records = link.usage
    assert sum(r.completion_tokens for r in records) == 8 and sum(r.requests for r in records) == 2


async def test_an_assembled_answer_cut_short_is_an_error_not_a_short_answer(
    upstreams: Any, link: MemoryLink,
) -> None:
    await _reporting(upstreams, link, "cut", tokens=5, cut_stream_after=2)
    async with running_gateway(link) as (_, url):
        with pytest.raises(openai.APIStatusError) as failed:
            await async_client(url).chat.completions.create(model="m", messages=MESSAGES)
    assert failed.value.status_code == 502
    assert failed.value.code == "upstream_incomplete"


async def test_a_client_that_leaves_closes_the_stream_under_its_answer(
    upstreams: Any, link: MemoryLink,
) -> None:
    engine = await _reporting(upstreams, link, "slow", tokens=200, token_delay_s=0.05)
    async with running_gateway(link) as (_, url):
        impatient = async_client(url, timeout=0.5)
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="m", messages=MESSAGES)
        # The engine's stream is cancelled within moments, not after 10 s of tokens.
        await eventually(lambda: engine.cancelled, 5, what="engine.cancelled")
        assert engine.cancelled == 1 and time.monotonic() - started < 5
        assert engine.seen[-1].body["stream"] is True
    # What it generated before the client left is metered, as an error.
    await eventually(lambda: link.usage, 5, what="link.usage")
    assert [r.errors for r in link.usage] == [1]


def test_a_stop_string_the_engine_matched_is_counted_with_the_text() -> None:
    # llama_cpp.server counts the tokens of the stop string it matched and
    # never sends them (6 tokens reported for a 5-token text ending at "\n").
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    assembler = Assembler(chat=False)
    assembler.add(_events(
        {**head, "choices": [{"index": 0, "text": "Say yes.", "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "finish_reason": "stop"},
                             {"index": 1, "text": "Cut", "finish_reason": "length"}]},
    ))  # fmt: skip
    assert assembler.tally.completions("\n") == ["Say yes.\n", "Cut"]
    assert assembler.tally.completions() == ["Say yes.", "Cut"]


async def test_an_assembled_answer_waits_for_its_count_longer_than_a_stream_does(
    unstopping_sim: SimEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A count slower than a stream's usage chunk may wait (one-slot engines queue it
    behind every waiting request) still gives the non-streamed answer its usage."""
    slow = counter.StreamCounter._usage

    async def slower(self: counter.StreamCounter, tally: StreamTally) -> Any:
        await asyncio.sleep(0.6)
        return await slow(self, tally)

    monkeypatch.setattr(counter.StreamCounter, "_usage", slower)
    monkeypatch.setattr(counter, "COUNT_TIMEOUT_S", 0.3)
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_route(unstopping_sim.url, UNSTOPPING)]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        built = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)
        assert built.usage is not None and built.usage.completion_tokens == 5
        # A stream's usage chunk is not waited for that long: it is left out.
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=5, stream=True,
            stream_options={"include_usage": True})]  # fmt: skip
        assert all(c.usage is None for c in chunks)
