"""llama_cpp.server's dialect, mended by the gateway, against the real engine.

The engine ignores ``stream_options`` and ``max_completion_tokens``; with the
dialect the llama.cpp adapter declares for it, the gateway adds the usage
chunk (counted with the engine's own tokenizer) and sends the limit as
``max_tokens``. Exactness is checked against the engine itself: a streamed
request must report what the same request reports unstreamed at
temperature 0.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.sims import counts, metered
from tests.gateway.test_real_engine import (  # noqa: F401 (fixture)
    COUNTING,
    SERVED,
    Engine,
    _until,
    engine,
    llama_server,
    one_token_s,
    token_times,
)
from tests.waiting import eventually

from llmgw import wire
from llmgw.agent.engines.llamacpppython import PYTHON_DIALECT
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"
# What an abandoned unstreamed request asks for (its client leaves after ~8).
LEFT_AT = 200


# The engine's own unstreamed answers, passed through: the reference that
# what the gateway makes (counted usage, assembled answers) is checked against.
DIRECT = PYTHON_DIALECT.model_copy(update={"stops_unstreamed": True})


def _config(
    real: Engine, dialect: wire.EngineDialect | None = PYTHON_DIALECT
) -> wire.GatewayConfig:
    routes = []
    for name, spoken in (("gemma", dialect), ("direct", DIRECT)):
        endpoint = wire.Endpoint(replica_id=f"llama-{name}", url=real.url, dialect=spoken)
        routes.append(wire.ModelRoute(name=name, served_name=SERVED, endpoints=[endpoint]))
    return make_config(1, routes)


async def test_stream_usage_is_exact_and_limits_hold(engine: Engine) -> None:  # noqa: F811
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(_config(engine))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        chat: dict[str, Any] = {"model": "gemma", "messages": CHAT, "temperature": 0,
                                "max_tokens": 12}  # fmt: skip
        whole = await client.chat.completions.create(**dict(chat, model="direct"))
        assert whole.usage is not None
        stream = await client.chat.completions.create(
            **chat, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and chunks[-1] is with_usage[0]
        assert with_usage[0].choices == []
        usage = with_usage[0].usage
        assert usage is not None
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        # The chat prompt is the templated one the engine evaluated, not the text.
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens
        )  # fmt: skip
        for chunk in chunks:
            assert chunk.id and chunk.created and chunk.model and chunk.object

        plain: dict[str, Any] = {"model": "gemma", "prompt": PROMPT, "temperature": 0,
                                 "max_tokens": 8}  # fmt: skip
        whole_text = await client.completions.create(**dict(plain, model="direct"))
        assert whole_text.usage is not None
        streamed = await client.completions.create(
            **plain, stream=True, stream_options={"include_usage": True}
        )
        last = [chunk async for chunk in streamed][-1]
        assert last.usage is not None and last.choices == []
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            whole_text.usage.prompt_tokens, whole_text.usage.completion_tokens
        )  # fmt: skip

        # max_completion_tokens, which the engine ignores, bounds the answer.
        limited = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count from 1 to 50."}],
            temperature=0, max_completion_tokens=5,
        )  # fmt: skip
        assert limited.usage is not None and limited.usage.completion_tokens <= 5
        assert limited.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count from 1 to 50."}],
            temperature=0, max_completion_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        last_chunk = [chunk async for chunk in stream][-1]
        assert last_chunk.usage is not None and last_chunk.usage.completion_tokens <= 5

        # Usage records carry the exact counts of all six requests.
        expected = (
            2 * whole.usage.prompt_tokens + 2 * whole_text.usage.prompt_tokens
            + limited.usage.prompt_tokens + last_chunk.usage.prompt_tokens,
            2 * whole.usage.completion_tokens + 2 * whole_text.usage.completion_tokens
            + limited.usage.completion_tokens + last_chunk.usage.completion_tokens,
        )  # fmt: skip
        await eventually(lambda: metered(link) == expected, 5, what=f"{expected} metered",
                         note=lambda: metered(link))  # fmt: skip


async def test_a_prompt_longer_than_the_context_gets_the_engines_400(
    engine: Engine,  # noqa: F811
) -> None:
    """The engine checks a prompt against its context only once its stream has
    started, and the stream then ends empty: the client used to get a 502
    (unstreamed, the gateway streams it) or a stream with one error event.
    It gets the 400 OpenAI and vLLM send, with the engine's message."""
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(_config(engine))
    long = "word " * 3000  # over 3,000 tokens; the engine's context is 2,048
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        for stream in (False, True):
            asks: list[tuple[Any, dict[str, Any]]] = [
                (client.chat.completions, {"messages": [{"role": "user", "content": long}]}),
                (client.completions, {"prompt": long}),
            ]
            for api, ask in asks:
                with pytest.raises(openai.BadRequestError) as refused:
                    await api.create(model="gemma", max_tokens=5, stream=stream, **ask)
                assert refused.value.status_code == 400
                assert refused.value.code == "context_length_exceeded"
                assert "maximum context length is 2048 tokens" in refused.value.message
                # The client's own limit is what the engine counts.
                assert re.search(r"\b5 (for|in) the completion", refused.value.message)
        # A prompt that fits: one request to the engine, as before.
        before = engine.requests()
        answer = await client.completions.create(model="gemma", prompt=PROMPT, max_tokens=3)
        assert answer.choices[0].text
        await _until(lambda: engine.requests() > before)
        await asyncio.sleep(0.3)
        assert engine.requests() == before + 1


async def test_concurrent_streams_are_each_counted_exactly(engine: Engine) -> None:  # noqa: F811
    """Two streams at once on an engine that serves one request at a time: each
    count waits its turn, and each still equals its request's unstreamed run."""
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(_config(engine))
    asks: list[dict[str, Any]] = [
        {"model": "gemma", "temperature": 0, "max_tokens": 10,
         "messages": [{"role": "user", "content": f"Write a line about the number {n}."}]}
        for n in (7, 12)
    ]  # fmt: skip
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        wholes = [await client.chat.completions.create(**dict(ask, model="direct"))
                  for ask in asks]  # fmt: skip

        async def streamed(ask: dict[str, Any]) -> Any:
            stream = await client.chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
            return [chunk async for chunk in stream][-1].usage

        usages = await asyncio.gather(*(streamed(ask) for ask in asks))
    for whole, usage in zip(wholes, usages, strict=True):
        assert whole.usage is not None and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens
        )  # fmt: skip


@pytest.fixture(scope="module")
def interrupting_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """llama_cpp.server as it starts by default: interrupt_requests on."""
    with llama_server(tmp_path_factory.mktemp("interrupting")) as running:
        yield running


async def test_a_stream_the_engine_interrupts_is_an_error(interrupting_engine: Engine) -> None:
    """The issue's measurement: a second request cut a running stream, and the
    client saw a normal end. Through the gateway it sees an error instead."""
    link = MemoryLink(poll_timeout_s=1.0)
    # No dialect: nothing of the gateway's own (its prompt count, which this
    # engine would also take for an interruption) may be what cuts the stream.
    link.publish(_config(interrupting_engine, None))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        stream = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count from 1 to 100."}],
            temperature=0, max_tokens=200, stream=True,
        )  # fmt: skip
        chunks = 0
        second: asyncio.Task[Any] | None = None
        with pytest.raises(openai.APIError, match="before finishing"):
            async for _ in stream:
                chunks += 1
                if chunks == 3:
                    second = asyncio.create_task(client.chat.completions.create(
                        model="gemma", messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=2,
                    ))  # fmt: skip
        assert second is not None
        assert (await second).choices[0].message is not None
        assert 3 <= chunks < 200


async def test_unstreamed_answers_are_the_engines_own_and_a_client_that_leaves_stops_it(
    engine: Engine, test_output: Path,  # noqa: F811
) -> None:
    """llama_cpp.server finishes an unstreamed request whatever its client does;
    asked for a stream by the gateway, it stops when the client leaves. What
    the client gets is the unstreamed answer the engine itself would have sent."""
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(_config(engine))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        # Identical at temperature 0: content, finish reason and usage (the
        # chat prompt as the engine templated it), for chat and completions.
        asks: list[dict[str, Any]] = [
            {"messages": CHAT, "temperature": 0, "max_tokens": 12},
            {"messages": [{"role": "user", "content": "Say yes."}], "temperature": 0,
             "max_tokens": 60, "stop": ["\n"]},  # ends at its stop: finish_reason "stop"
        ]  # fmt: skip
        reasons = set()
        for ask in asks:
            built = await client.chat.completions.create(model="gemma", **ask)
            own = await client.chat.completions.create(model="direct", **ask)
            assert built.object == own.object == "chat.completion"
            assert built.id.startswith("chatcmpl-") and built.created > 0
            assert built.model == own.model == SERVED
            assert built.choices[0].index == 0
            assert built.choices[0].message.role == own.choices[0].message.role == "assistant"
            assert built.choices[0].message.content == own.choices[0].message.content
            assert built.choices[0].finish_reason == own.choices[0].finish_reason
            assert counts(built.usage) == counts(own.usage)
            reasons.add(built.choices[0].finish_reason)
        assert reasons == {"length", "stop"}
        plain: dict[str, Any] = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}
        built_text = await client.completions.create(model="gemma", **plain)
        own_text = await client.completions.create(model="direct", **plain)
        assert built_text.object == own_text.object == "text_completion"
        assert built_text.choices[0].text == own_text.choices[0].text
        assert built_text.choices[0].finish_reason == own_text.choices[0].finish_reason
        assert counts(built_text.usage)[:2] == counts(own_text.usage)[:2]

        # Tokens generated after the client leaves, measured by the queue
        # behind the engine (see test_real_engine.py): before (the engine's
        # own unstreamed request) and after (a stream under the answer).
        idle_s, per_token_s = await token_times(client, "direct")
        impatient = async_client(url, timeout=idle_s + 8 * per_token_s)
        after: dict[str, float] = {}
        for name in ("direct", "gemma"):
            disconnects = engine.disconnects()
            with pytest.raises(openai.APITimeoutError):
                await impatient.completions.create(
                    model=name, prompt=COUNTING, max_tokens=LEFT_AT, temperature=0
                )
            after[name] = max(0.0, await one_token_s(client, "direct") - idle_s) / per_token_s
            if name == "gemma":
                await _until(lambda d=disconnects: engine.disconnects() > d)
                assert engine.disconnects() == disconnects + 1, "the engine never saw it leave"

    figures = {
        "per_token_ms": round(per_token_s * 1000, 1),
        "idle_one_token_ms": round(idle_s * 1000, 1),
        "asked_tokens": LEFT_AT,
        "client_left_after_tokens": 8,
        "tokens_after_disconnect_before": round(after["direct"], 1),
        "tokens_after_disconnect_after": round(after["gemma"], 1),
    }
    (test_output / "gateway-unstreamed-disconnect.json").write_text(json.dumps(figures, indent=1))
    # Before: the engine runs on to its limit (about LEFT_AT - 8 tokens).
    # After: a few tokens of slack for the token in flight and a noisy machine.
    assert after["direct"] > LEFT_AT / 4, figures
    assert after["gemma"] < 25, figures
