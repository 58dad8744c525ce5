"""Request validation: OpenAI's envelope per route, refused with 400 and the offending param.

The table is unit-level (every rule, cheaply); the gateway tests show the
same refusals through the running gateway with the official client, that a
refused request reaches no engine and wakes no on-demand model, and that
fields the gateway does not know pass through untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionUserMessageParam
from tests.gateway.conftest import async_client, make_config, route, running_gateway

from llmgw.gateway.app import Gateway
from llmgw.gateway.checks.validation import ENVELOPES, check_request
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.replies import ApiError
from llmgw.gateway.routes.table import ROUTES

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
USER: ChatCompletionUserMessageParam = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once", **fields}


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "text", **fields}


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # The bodies.
    (CHAT, {"model": "m"}, "messages", "missing_required_parameter"),
    (CHAT, {"model": "m", "messages": "not a list", "max_tokens": "ten"}, "messages",
     "invalid_type"),
    (CHAT, chat(max_tokens="ten"), "max_tokens", "invalid_type"),
    # model
    (CHAT, {"messages": [USER]}, "model", "missing_required_parameter"),
    (CHAT, chat(model=""), "model", "empty_string"),
    (CHAT, chat(model=7), "model", "invalid_type"),
    # messages
    (CHAT, chat(messages=[]), "messages", "empty_array"),
    (CHAT, chat(messages=None), "messages", "missing_required_parameter"),
    (CHAT, chat(messages=[USER, "hi"]), "messages[1]", "invalid_type"),
    (CHAT, chat(messages=[USER, {"role": "bot", "content": "x"}]), "messages[1].role",
     "invalid_value"),
    (CHAT, chat(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role",
     "invalid_type"),
    (CHAT, chat(messages=[USER, USER, {"role": {"user": 1}, "content": "x"}]), "messages[2].role",
     "invalid_type"),
    (CHAT, chat(messages=[USER, {"role": 1, "content": "x"}]), "messages[1].role",
     "invalid_type"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content",
     "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "system", "content": None}]), "messages[0].content",
     "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": []}]), "messages[0].content",
     "empty_array"),
    (CHAT, chat(messages=[{"role": "user", "content": ["hi"]}]), "messages[0].content[0]",
     "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]),
     "messages[0].content[0].type", "missing_required_parameter"),
    (CHAT, chat(messages=[USER, {"role": "tool", "content": "42"}]), "messages[1].tool_call_id",
     "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": 3}]), "messages[0].name",
     "invalid_type"),
    # limits: booleans and decimals are not integers
    (CHAT, chat(max_tokens=True), "max_tokens", "invalid_type"),
    (CHAT, chat(max_tokens=10.0), "max_tokens", "invalid_type"),
    (CHAT, chat(max_tokens=0), "max_tokens", "integer_below_min_value"),
    (CHAT, chat(max_completion_tokens=False), "max_completion_tokens", "invalid_type"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "integer_below_min_value"),
    (CHAT, chat(n=0), "n", "integer_below_min_value"),
    (CHAT, chat(n=129), "n", "integer_above_max_value"),
    (CHAT, chat(n="2"), "n", "invalid_type"),
    # sampling
    (CHAT, chat(temperature=2.5), "temperature", "decimal_above_max_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "decimal_below_min_value"),
    (CHAT, chat(temperature="hot"), "temperature", "invalid_type"),
    (CHAT, chat(temperature=True), "temperature", "invalid_type"),
    (CHAT, chat(top_p=1.5), "top_p", "decimal_above_max_value"),
    (CHAT, chat(presence_penalty=-3), "presence_penalty", "decimal_below_min_value"),
    (CHAT, chat(frequency_penalty=2.01), "frequency_penalty", "decimal_above_max_value"),
    (CHAT, chat(seed=1.5), "seed", "invalid_type"),
    (CHAT, chat(user=1), "user", "invalid_type"),
    (CHAT, chat(logit_bias={"50256": 101}), "logit_bias.50256", "decimal_above_max_value"),
    (CHAT, chat(logit_bias=[1]), "logit_bias", "invalid_type"),
    # streaming
    (CHAT, chat(stream="yes"), "stream", "invalid_type"),
    (CHAT, chat(stream=1), "stream", "invalid_type"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (CHAT, chat(stream=False, stream_options={"include_usage": True}), "stream_options",
     "invalid_value"),
    (CHAT, chat(stream=True, stream_options=True), "stream_options", "invalid_type"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage", "invalid_type"),
    # stop
    (CHAT, chat(stop=5), "stop", "invalid_type"),
    (CHAT, chat(stop=["a", 1]), "stop[1]", "invalid_type"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length"),
    # logprobs
    (CHAT, chat(logprobs=1), "logprobs", "invalid_type"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "integer_above_max_value"),
    (CHAT, chat(top_logprobs=3), "top_logprobs", "invalid_value"),
    # tools
    (CHAT, chat(tools={"type": "function"}), "tools", "invalid_type"),
    (CHAT, chat(tools=[{"function": {}}]), "tools[0].type", "missing_required_parameter"),
    (CHAT, chat(tool_choice=1), "tool_choice", "invalid_type"),
    (CHAT, chat(response_format="json"), "response_format", "invalid_type"),
    # completions
    (COMPLETIONS, {"model": "m"}, "prompt", "missing_required_parameter"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "empty_array"),
    (COMPLETIONS, completion(prompt=5), "prompt", "invalid_type"),
    (COMPLETIONS, completion(prompt=["a", 1]), "prompt[1]", "invalid_type"),
    (COMPLETIONS, completion(prompt=[1, True]), "prompt[1]", "invalid_type"),
    (COMPLETIONS, completion(prompt=[1, -2]), "prompt[1]", "integer_below_min_value"),
    (COMPLETIONS, completion(prompt=[[1], "a"]), "prompt[1]", "invalid_type"),
    (COMPLETIONS, completion(prompt=[[1], []]), "prompt[1]", "empty_array"),
    (COMPLETIONS, completion(max_tokens=-1), "max_tokens", "integer_below_min_value"),
    (COMPLETIONS, completion(logprobs=True), "logprobs", "invalid_type"),
    (COMPLETIONS, completion(logprobs=6), "logprobs", "integer_above_max_value"),
    (COMPLETIONS, completion(echo="no"), "echo", "invalid_type"),
    (COMPLETIONS, completion(n=3, best_of=2), "best_of", "invalid_value"),
    (COMPLETIONS, completion(stream_options={}), "stream_options", "invalid_value"),
    # embeddings
    (EMBEDDINGS, {"model": "m"}, "input", "missing_required_parameter"),
    (EMBEDDINGS, embedding(input=""), "input", "empty_string"),
    (EMBEDDINGS, embedding(input=["a", ""]), "input[1]", "empty_string"),
    (EMBEDDINGS, embedding(input=[]), "input", "empty_array"),
    (EMBEDDINGS, embedding(input={"text": "a"}), "input", "invalid_type"),
    (EMBEDDINGS, embedding(input=["a"] * 2049), "input", "array_above_max_length"),
    (EMBEDDINGS, embedding(dimensions=0), "dimensions", "integer_below_min_value"),
    (EMBEDDINGS, embedding(encoding_format="int8"), "encoding_format", "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD)
def test_a_wrong_body_names_its_param(
    path: str, body: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(ApiError) as refused:
        check_request(path, body)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.kind == "invalid_request_error"
    assert param in error.message


GOOD: list[tuple[str, dict[str, Any]]] = [
    (CHAT, chat()),
    (CHAT, chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Really."}]},
            USER,
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "function", "name": "f", "content": None},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ],
        max_tokens=16, max_completion_tokens=16, n=2, temperature=0, top_p=1,
        presence_penalty=-2, frequency_penalty=2.0, stream=True,
        stream_options={"include_usage": True}, stop=["\n", "."], seed=-5, user="u",
        logprobs=True, top_logprobs=0, logit_bias={"1": -100}, tools=[{"type": "function"}],
        tool_choice="auto", response_format={"type": "json_object"},
    )),
    # null is "the default" wherever OpenAI allows it
    (CHAT, chat(max_tokens=None, temperature=None, stop=None, stream=None, stream_options=None,
                top_logprobs=None, n=None, seed=None)),
    # fields the gateway does not know are the engine's
    (CHAT, chat(top_k="anything", min_p=[1], chat_template_kwargs={"x": 1})),
    (COMPLETIONS, completion()),
    (COMPLETIONS, completion(prompt="")),
    (COMPLETIONS, completion(prompt=["a", "b"], max_tokens=0, echo=True, logprobs=5)),
    (COMPLETIONS, completion(prompt=[1, 2, 3], best_of=3, n=3, suffix="!")),
    (COMPLETIONS, completion(prompt=[[1, 2], [3]], stream=True, stream_options={})),
    (EMBEDDINGS, embedding()),
    (EMBEDDINGS, embedding(input=["a", "b"], dimensions=64, encoding_format="base64")),
    (EMBEDDINGS, embedding(input=[[1, 2], [3]])),
    (EMBEDDINGS, embedding(input=[1, 2, 3])),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), GOOD)
def test_a_right_body_passes_unchanged(path: str, body: dict[str, Any]) -> None:
    before = orjson.dumps(body)
    check_request(path, body)
    assert orjson.dumps(body) == before


def test_every_proxied_route_has_an_envelope() -> None:
    posted = {path for method, path in Gateway(MemoryLink()).routes() if method == "POST"}
    assert set(ENVELOPES) == posted == set(ROUTES)


# -- through the gateway ----------------------------------------------------------


async def test_refused_before_any_engine_or_wake(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine]), route("lazy", [], on_demand=True)]))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        for model in ("m", "lazy"):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model=model,
                    messages=[USER, {"role": "bot", "content": "x"}],  # type: ignore[misc,list-item]
                )
            assert refused.value.param == "messages[1].role"
            assert refused.value.code == "invalid_value"
            assert refused.value.type == "invalid_request_error"
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=model, messages=[USER], max_tokens=True)
            assert refused.value.param == "max_tokens"
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model=model, messages=[USER], extra_body={"stream_options": {}}
                )
            assert refused.value.param == "stream_options"
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=model, prompt=[])
            assert refused.value.param == "prompt"
            with pytest.raises(openai.BadRequestError) as refused:
                await client.embeddings.create(model=model, input="")
            assert refused.value.param == "input"
        await asyncio.sleep(0.1)
        assert engine.seen == []
        assert link.demands == []  # the on-demand model was not woken
        assert gateway.runtime.room.waiting() == {}
        assert 'llmgw_gateway_requests_total{model="-",status="400"} 10.0' in (
            gateway.metrics.render().decode()
        )


async def test_unknown_fields_reach_the_engine_untouched(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine], served_name="m")]))
    async with running_gateway(link) as (_, url):
        extra = {"top_k": 40, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False},
                 "cache_prompt": True}  # fmt: skip
        answer = await async_client(url).chat.completions.create(
            model="m", messages=[USER], max_tokens=8, extra_body=extra
        )
        assert answer.choices[0].message.content == "hello from e1"
    (seen,) = engine.seen
    assert seen.body == {"model": "m", "messages": [USER], "max_tokens": 8, **extra}
