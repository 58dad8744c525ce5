"""What llama_cpp.server cannot do, as the agent starts it, against the real engine.

The engine runs with the flags the agent gives it (``--interrupt_requests
false``, ``--logits_all false``, no ``--embedding``) and the gateway routes
to it with the dialect the adapter declares for that launch. Each request
here once reached the client as a 500 in the engine's words, a stream cut
short, or a silently wrong answer; now it is mended (the ``developer``
role), refused with OpenAI's error naming what to change (embeddings,
logprobs, ``n``), or, where the engine itself fails, answered without the
engine's internals.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tests.agent.helpers import assign, cpu_slot, model
from tests.gateway.conftest import (
    assert_route_not_served,
    async_client,
    make_config,
    running_gateway,
)
from tests.gateway.test_real_engine import SERVED, Engine, llama_server

from llmgw import wire
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.llamacpp import LlamaCppAdapter
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

HI: list[Any] = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def agents_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp("engine")
    with llama_server(folder, "--interrupt_requests", "false", "--logits_all", "false") as run:
        yield run


def _dialect() -> wire.EngineDialect:
    """The dialect the adapter declares for llama_cpp.server started as above."""
    gguf = wire.WeightsSource(kind="local", path="/w/gemma-3-270m.gguf")
    spec = assign(model(wire.EngineKind.LLAMACPP, weights=gguf), [cpu_slot(0)])
    ctx = LaunchContext(assignment=spec, weights_path=gguf.path, host="127.0.0.1", port=8000,
                        devices=[cpu_slot(0)])  # fmt: skip
    return LlamaCppAdapter(server_binary="").build(ctx).dialect


def _link(engine: Engine) -> MemoryLink:
    # "gemma" as the agent reports it; "raw" with no dialect (an agent
    # predating dialects): nothing mended or refused, the engine answers itself.
    routes = [
        wire.ModelRoute(name=name, served_name=SERVED, endpoints=[
            wire.Endpoint(replica_id=f"llama-{name}", url=engine.url, dialect=dialect)])
        for name, dialect in (("gemma", _dialect()), ("raw", None))
    ]  # fmt: skip
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, routes))
    return link


async def test_embeddings_of_a_chat_engine_get_openais_404(agents_engine: Engine) -> None:
    async with running_gateway(_link(agents_engine)) as (_, url):
        client = async_client(url, timeout=60)
        before = agents_engine.requests()
        with pytest.raises(openai.NotFoundError) as refused:
            await client.embeddings.create(model="gemma", input="hi")
        assert_route_not_served(refused, "/v1/embeddings")
        assert agents_engine.requests() == before  # never sent


async def test_a_developer_message_is_sent_as_system(agents_engine: Engine) -> None:
    async with running_gateway(_link(agents_engine)) as (_, url):
        client = async_client(url, timeout=120)
        ask: dict[str, Any] = {"model": "gemma", "temperature": 0, "max_tokens": 8}
        rule = "Answer in French."
        system = await client.chat.completions.create(
            **ask, messages=[{"role": "system", "content": rule}, *HI])  # fmt: skip
        developer = await client.chat.completions.create(
            **ask, messages=[{"role": "developer", "content": rule}, *HI])  # fmt: skip
        assert developer.choices[0].message.content == system.choices[0].message.content
        stream = await client.chat.completions.create(
            model="gemma", temperature=0, max_tokens=8, stream=True,
            messages=[{"role": "developer", "content": rule}, *HI])  # fmt: skip
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == system.choices[0].message.content


async def test_what_the_engine_cannot_answer_is_refused_naming_the_field(
    agents_engine: Engine,
) -> None:
    async with running_gateway(_link(agents_engine)) as (_, url):
        client = async_client(url, timeout=60)
        before = agents_engine.requests()
        chat: dict[str, Any] = {"model": "gemma", "messages": HI, "max_tokens": 4}
        cases: list[tuple[str, dict[str, Any]]] = [
            ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
            ("top_logprobs", {"logprobs": True, "top_logprobs": 2, "stream": True}),
            ("logprobs", {"logprobs": True}),  # answered logprobs: null before
            ("n", {"n": 2}),  # answered one choice before
            ("n", {"n": 2, "stream": True}),
        ]
        for param, extra in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(**chat, **extra)
            error = refused.value.body
            assert isinstance(error, dict), extra
            assert (error["param"], error["code"]) == (param, "unsupported_parameter"), extra
            assert f"`{param}`" in error["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="gemma", prompt="Hi", max_tokens=4, logprobs=2)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "logprobs"
        assert agents_engine.requests() == before  # none of them was sent
        # What the engine can do still passes.
        one = await client.chat.completions.create(**chat, n=1)
        assert len(one.choices) == 1


async def test_an_engines_failure_reaches_the_client_without_its_internals(
    agents_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running_gateway(_link(agents_engine)) as (_, url):
        client = async_client(url, timeout=60)
        # Unmended, the engine fails on this with a 500 carrying pydantic's
        # validation error and its traceback's file paths.
        developer: list[Any] = [{"role": "developer", "content": "x"}, *HI]
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as failed:
                await client.chat.completions.create(
                    model="raw", messages=developer, max_tokens=4, stream=stream)  # fmt: skip
            request_id = failed.value.response.headers["x-request-id"]
            error = failed.value.body
            assert isinstance(error, dict)
            assert (error["type"], error["code"]) == ("server_error", "engine_error")
            assert request_id in error["message"] and "`raw`" in error["message"]
            assert "validation" not in failed.value.response.text
            assert "File " not in failed.value.response.text
            assert f"request {request_id}: the engine of `raw` failed (HTTP 500)" in caplog.text
        assert "validation error" in caplog.text  # the engine's words, for the operator
