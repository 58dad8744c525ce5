"""The official openai client, sync and async, streaming and not, against a sim engine."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.sim.helpers import StartEngine, until

from llmgw.sim import tokens
from llmgw.sim.engine import SimEngine

SYSTEM = tokens.random_words(__import__("random").Random(1), 200)
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "what is the answer"},
]


def aclient(engine: SimEngine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


async def test_async_chat_stream_with_usage_and_cached_tokens(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m")
    expected_prompt = tokens.count_tokens(tokens.render_chat(MESSAGES))
    async with aclient(engine) as client:
        for attempt in range(2):
            stream = await client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces, finish, usage, roles = [], None, None, []
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.role:
                        roles.append(choice.delta.role)
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                    finish = choice.finish_reason or finish
            assert roles == ["assistant"]
            assert len(pieces) == 7, "one chunk per token"
            assert "".join(pieces) == tokens.filler_text(7)
            assert finish == "length"
            assert usage is not None
            assert usage.prompt_tokens == expected_prompt
            assert usage.completion_tokens == 7
            assert usage.total_tokens == expected_prompt + 7
            assert usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens
            if attempt == 0:
                assert cached == 0
            else:
                # Every full block but the one holding the last prompt token.
                block = engine.params.block_tokens
                assert cached == (expected_prompt - 1) // block * block


async def test_async_completions_whole_and_stream(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m")
    async with aclient(engine) as client:
        whole = await client.completions.create(model="m", prompt="abc def ghi ", max_tokens=4)
        assert whole.choices[0].text == tokens.filler_text(4)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 4)
        stream = await client.completions.create(
            model="m", prompt="abc def ghi ", max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text == tokens.filler_text(4)


async def test_stream_ends_with_done_marker(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m")
    body = {"model": "m", "prompt": "hello", "max_tokens": 3, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3 + 1 + 1  # tokens, finish chunk, [DONE]


def test_sync_client_chat_completions_models_embeddings(threaded_engine: SimEngine) -> None:
    client = openai.OpenAI(base_url=threaded_engine.url + "/v1", api_key="x", max_retries=0)
    with client:
        models = client.models.list()
        assert [m.id for m in models.data] == ["sim"]
        chat = client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content == tokens.filler_text(3)
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        stream = client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
            tokens.filler_text(5)
        )
        comp = client.completions.create(model="sim", prompt="hi", max_tokens=2)
        assert comp.choices[0].text == tokens.filler_text(2)
        first = client.embeddings.create(model="sim", input=["alpha", "beta"])
        again = client.embeddings.create(model="sim", input="alpha", encoding_format="float")
        assert len(first.data) == 2 and len(first.data[0].embedding) == 16
        assert first.data[0].embedding == pytest.approx(again.data[0].embedding, abs=1e-6)
        assert first.data[0].embedding != pytest.approx(first.data[1].embedding, abs=1e-6)
        assert sum(v * v for v in first.data[0].embedding) == pytest.approx(1.0, abs=1e-5)


async def test_unknown_model_and_bad_requests(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", kv_blocks=8, block_tokens=4)
    async with aclient(engine) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "x"}]
            )
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.completions.create(model="m", prompt="x", max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="KV blocks"):
            await client.completions.create(model="m", prompt="x", max_tokens=100)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]"):
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "image_url"}]}],  # type: ignore[misc,list-item]
            )
    async with (
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/v1/completions", data=b"{not json") as resp,
    ):
        assert resp.status == 400
        assert "not JSON" in (await resp.json())["error"]["message"]


async def test_health_and_models_wait_for_start_up(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", ready=False, startup_s=0.3)
    async with aiohttp.ClientSession() as http:
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 503
        async with http.get(engine.url + "/v1/models") as resp:
            assert resp.status == 503
        assert await engine.wait_ready()
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 200


async def test_client_hanging_up_frees_the_request(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", decode_ms_per_token=5.0)
    body = {"model": "m", "prompt": "x" * 400, "max_tokens": 1000, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(engine.url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        assert engine.core.running == 1 and engine.core.kv.used_blocks > 0
        resp.close()
    await until(lambda: engine.core.running == 0)
    assert engine.core.kv.used_blocks == 0
    assert engine.core.counters.aborted == 1
