"""The OpenAI API through the gateway, with the official client, sync and async."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import (
    SECRET,
    async_client,
    fast_settings,
    make_config,
    route,
    running_gateway,
    sync_client,
)

from llmgw.gateway.link import MemoryLink


async def test_chat_async_plain_and_streamed(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=4)
    link.publish(make_config(1, [route("chat-model", [engine], aliases=["cm"])]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        started = time.perf_counter()
        answer = await client.chat.completions.with_raw_response.create(
            model="chat-model", messages=[{"role": "user", "content": "hi"}]
        )
        wall_ms = (time.perf_counter() - started) * 1000
        assert len(answer.headers["x-request-id"]) == 32  # UUID-shaped: engines may parse it
        # The gateway's own share of the request: a part of what the client waited, not more.
        assert 0 <= float(answer.headers["x-llmgw-overhead-ms"]) < wall_ms
        completion = answer.parse()
        assert completion.choices[0].message.content == "hello from e1"
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        # The engine saw its own name for the model, not the client's alias.
        assert engine.seen[-1].body["model"] == "served/chat-model"
        assert engine.seen[-1].headers["x-request-id"] == answer.headers["x-request-id"]

        stream = await client.chat.completions.create(
            model="cm", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "hello from e1 t1 t2 t3"
        # The gateway asked for usage upstream but the client did not: no usage chunk.
        assert engine.seen[-1].body["stream_options"] == {"include_usage": True}
        assert all(c.choices for c in chunks)


async def test_stream_usage_honoured_when_asked(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=3)
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (_, url):
        stream = await async_client(url).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_completions_embeddings_models_sync(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=2)
    link.publish(make_config(1, [route("base", [engine]), route("embed", [engine])]))
    async with running_gateway(link) as (_, url):

        def calls() -> tuple[Any, ...]:
            client = sync_client(url)
            completion = client.completions.create(model="base", prompt="Once upon")
            streamed = list(
                client.completions.create(model="base", prompt="Once upon", stream=True)
            )
            embedding = client.embeddings.create(model="embed", input=["a", "b"])
            models = client.models.list()
            one = client.models.retrieve("embed")
            return completion, streamed, embedding, models, one

        completion, streamed, embedding, models, one = await asyncio.to_thread(calls)
        assert completion.choices[0].text == "hello from e1"
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "hello from e1 t1"
        assert [d.embedding for d in embedding.data] == [[0.25, -0.5, 0.0], [0.25, -0.5, 1.0]]
        assert embedding.usage.prompt_tokens == 8
        assert sorted(m.id for m in models.data) == ["base", "embed"]
        assert one.id == "embed"
        assert [s.path for s in engine.seen] == [
            "/v1/completions",
            "/v1/completions",
            "/v1/embeddings",
        ]


async def test_chat_sync_streamed(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=3)
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (_, url):

        def call() -> str:
            stream = sync_client(url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        assert await asyncio.to_thread(call) == "hello from e1 t1 t2"


async def test_client_errors_are_openai_shaped(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link, fast_settings(max_body_bytes=2000)) as (_, url):
        client = async_client(url)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError) as bad_key:
            await async_client(url, "sk-llmgw-wrong-key-0000000000000").chat.completions.create(
                model="m", messages=messages
            )
        assert bad_key.value.code == "invalid_api_key"
        assert "sk-llmgw-wrong" not in bad_key.value.message  # the key is masked
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="nope", messages=messages)
        assert missing.value.code == "model_not_found"
        assert missing.value.body["param"] == "model"  # type: ignore[index]
        with pytest.raises(openai.APIStatusError) as too_big:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 5000}]
            )
        assert too_big.value.status_code == 413
        assert too_big.value.code == "body_too_large"
        assert too_big.value.body == {  # OpenAI's error shape, all four members
            "message": "Request body is larger than 2000 bytes.",
            "type": "invalid_request_error",
            "param": None,
            "code": "body_too_large",
        }

        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"}
            required = "missing_required_parameter"
            cases = [
                ("POST", "/v1/chat/completions", b"{not json", 400, "invalid_json"),
                ("POST", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
                ("POST", "/v1/chat/completions", b'{"messages": []}', 400, required),
                ("POST", "/v1/nothing-here", b"{}", 404, None),
                ("GET", "/v1/chat/completions", b"", 405, None),
            ]
            for method, path, body, status, code in cases:
                async with http.request(method, url + path, data=body, headers=headers) as resp:
                    payload = await resp.json()
                    assert resp.status == status, (path, body)
                    assert set(payload["error"]) == {"message", "type", "param", "code"}
                    assert payload["error"]["code"] == code
                    assert resp.headers["x-request-id"]

            # A chunked body over the limit (no Content-Length to refuse up front).
            async def chunks() -> Any:
                for _ in range(10):
                    yield b" " * 500

            async with http.post(
                url + "/v1/chat/completions", data=chunks(), headers=headers
            ) as resp:
                assert resp.status == 413
                assert (await resp.json())["error"]["code"] == "body_too_large"
            async with http.post(url + "/v1/chat/completions", data=b"{}") as resp:
                assert resp.status == 401
        assert engine.seen == []  # none of these reached the engine


async def test_before_first_config_answers_503(link: MemoryLink) -> None:
    link.fail = True
    async with running_gateway(link, wait=False) as (_, url):
        with pytest.raises(openai.InternalServerError) as unavailable:
            await async_client(url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["retry-after"] == "1"
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
            assert resp.status == 503


async def test_upstream_errors_pass_through_and_stream_break_is_an_sse_error(
    upstreams: Any, link: MemoryLink
) -> None:
    breaking = await upstreams("e1", tokens=5, break_stream_after=2)
    link.publish(make_config(1, [route("m", [breaking])]))
    async with running_gateway(link) as (_, url):
        stream = await async_client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        received: list[str] = []
        with pytest.raises(openai.APIError) as broke:
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
        assert received == ["hello from e1", " t1"]
        assert "stopped answering" in broke.value.message
        # Engines' own parameters are theirs to judge; their 4xx comes back as it is.
        with pytest.raises(openai.BadRequestError) as refused:
            await async_client(url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"top_k": "x"}
            )
        assert refused.value.code == "engine_refused"


async def test_metrics_and_health(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(7, [route("m", [engine])]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}], stream=True
        )
        _ = [c async for c in stream]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "a"}]
            )
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            async with http.get(url + "/health") as resp:
                health = await resp.json()
        assert health["version"] == 7
        assert 'llmgw_gateway_requests_total{model="m",status="200"} 2.0' in text
        assert 'llmgw_gateway_requests_total{model="-",status="404"} 1.0' in text
        assert 'llmgw_gateway_time_to_first_token_seconds_count{model="m"} 1.0' in text
        assert 'llmgw_gateway_request_seconds_count{model="m"} 2.0' in text
        assert 'llmgw_gateway_tokens_total{kind="completion",model="m"} 6.0' in text
        assert 'llmgw_gateway_in_flight{model="m"} 0.0' in text
        # One replica: no prefix work, so no hit or miss to report.
        assert 'llmgw_gateway_prefix_routing_total{model="m",outcome="none"} 2.0' in text
        assert 'outcome="miss"' not in text
        assert "llmgw_gateway_overhead_seconds_bucket" in text
