"""A stream the engine ends before its first event: the engine's own refusal reaches the client.

The fake engine refuses a prompt longer than its context as llama_cpp.server
does (400 unstreamed, an empty 200 stream streamed); the real engine is
tested in test_dialect_real_engine.py.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from tests.gateway.conftest import async_client, make_config, route, running_gateway

from llmgw import wire
from llmgw.gateway.link import MemoryLink

LONG = "word " * 400  # about 500 of the fake's tokens
CONTEXT = 100
# An engine like llama_cpp.server: unstreamed requests are sent as streams.
ASSEMBLING = wire.EngineDialect(stops_unstreamed=False)


def _asks(model: str, prompt: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("chat", {"model": model, "messages": [{"role": "user", "content": prompt}],
                  "max_tokens": 5}),
        ("completions", {"model": model, "prompt": prompt, "max_tokens": 5}),
    ]  # fmt: skip


async def _create(client: openai.AsyncOpenAI, kind: str, ask: dict[str, Any], stream: bool) -> Any:
    api = client.chat.completions if kind == "chat" else client.completions
    answer = await api.create(**ask, stream=stream)
    return [chunk async for chunk in answer] if stream else answer


@pytest.mark.parametrize("dialect", [None, ASSEMBLING], ids=["passed-through", "assembled"])
async def test_a_prompt_refused_inside_the_stream_gets_the_engines_400(
    upstreams: Any, link: MemoryLink, dialect: wire.EngineDialect | None
) -> None:
    engine = await upstreams("e1", context_tokens=CONTEXT)
    endpoint = wire.Endpoint(replica_id="e1", url=engine.url, dialect=dialect)
    link.publish(make_config(1, [route("m").model_copy(update={"endpoints": [endpoint]})]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        for kind, ask in _asks("m", LONG):
            for stream in (False, True):
                seen = len(engine.seen)
                with pytest.raises(openai.BadRequestError) as refused:
                    await _create(client, kind, ask, stream)
                assert refused.value.status_code == 400, (kind, stream)
                assert refused.value.code == "context_length_exceeded"
                assert f"maximum context length is {CONTEXT} tokens" in refused.value.message
                asked = engine.seen[seen:]
                if stream or dialect is not None:
                    # The stream, then the same request unstreamed with its limit.
                    assert [s.body.get("stream") for s in asked] == [True, None]
                    assert asked[1].body["max_tokens"] == 5
                else:
                    assert len(asked) == 1
        # A prompt that fits costs the engine its one request, as before.
        for kind, ask in _asks("m", "hi"):
            for stream in (False, True):
                seen = len(engine.seen)
                assert await _create(client, kind, ask, stream)
                assert len(engine.seen) == seen + 1


async def test_an_engine_that_refuses_before_its_stream_starts_is_relayed_as_is(
    upstreams: Any, link: MemoryLink
) -> None:
    """vLLM checks a request before it answers: its 400 to a stream comes back
    as that 400, with its own words, and is asked nothing more."""
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (_, url):
        with pytest.raises(openai.BadRequestError) as refused:
            await async_client(url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                extra_body={"top_k": "x"},
            )  # fmt: skip
        assert refused.value.status_code == 400
        assert (refused.value.code, refused.value.param) == ("engine_refused", "top_k")
        assert refused.value.message.endswith(" top_k must be an integer")
        assert len(engine.seen) == 1
