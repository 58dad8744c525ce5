"""The gateway calls each engine with its replica's key; the engine refuses anyone else.

The simulated engine is started with a key, as the agent starts every engine;
the official ``openai`` client talks to the gateway with its own API key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from tests.gateway.conftest import SECRET, async_client, make_config, running_gateway
from tests.gateway.sims import LLAMA_DIALECT, running_sim

from llmgw import wire
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.http.client import request_head
from llmgw.sim.engine import SimEngine

KEY = "engine-key-0123456789abcdefghijklmnopqrstu"
# llama_cpp.server's dialect on the sim's routes: streams are counted on the
# engine's tokenizer route, which needs the key as well.
COUNTED = LLAMA_DIALECT
ASK = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture
async def keyed_sim() -> AsyncIterator[SimEngine]:
    async with running_sim(api_key=KEY) as engine:
        yield engine


def _route(engine: SimEngine, key: str | None) -> wire.ModelRoute:
    endpoint = wire.Endpoint(replica_id="sim-1", url=engine.url, dialect=COUNTED, engine_key=key)
    return wire.ModelRoute(name="m", served_name="sim", endpoints=[endpoint])


async def test_the_engine_refuses_calls_without_its_key(keyed_sim: SimEngine) -> None:
    async with httpx.AsyncClient(base_url=keyed_sim.url) as client:
        for headers in ({}, {"Authorization": f"Bearer {SECRET}"}, {"Authorization": KEY}):
            answer = await client.post("/v1/chat/completions", json=ASK, headers=headers)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/metrics"):
            assert (await client.get(path)).status_code == 401
        assert (await client.get("/health")).status_code == 200  # as vLLM's
        keyed = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200


async def test_the_gateway_sends_the_replicas_key(keyed_sim: SimEngine) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_route(keyed_sim, KEY)]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        hello = [{"role": "user", "content": "hello there"}]
        reply = await client.chat.completions.create(model="m", messages=hello, max_tokens=4)  # type: ignore[arg-type]
        assert reply.choices[0].message.content
        # A counted stream: the gateway's calls to /tokenize carry the key too,
        # or the count (and the usage chunk) would be missing.
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=hello, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 4
        async with httpx.AsyncClient() as raw:
            answer = await raw.post(f"{url}/v1/chat/completions", json={**ASK, "model": "m"},
                                    headers={"Authorization": f"Bearer {SECRET}"})  # fmt: skip
        assert answer.status_code == 200
        assert KEY not in answer.text and KEY not in str(answer.headers)


async def test_an_engine_that_refuses_the_gateway_is_not_blamed_on_the_client(
    keyed_sim: SimEngine,
) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [_route(keyed_sim, None)]))
    async with running_gateway(link) as (_, url), httpx.AsyncClient() as raw:
        answer = await raw.post(f"{url}/v1/chat/completions", json={**ASK, "model": "m"},
                                headers={"Authorization": f"Bearer {SECRET}"})  # fmt: skip
        # The client's key is fine: no 401 for it, but no replica takes the request.
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "upstream_unavailable"


def test_the_key_is_rendered_into_the_constant_head_once() -> None:
    head = request_head("10.0.0.1", 20001, "/v1/completions", KEY)
    assert f"\r\nAuthorization: Bearer {KEY}\r\n".encode() in head
    assert b"Authorization" not in request_head("10.0.0.1", 20001, "/v1/completions")
    upstream = Upstream(GatewaySettings())
    target = upstream.target("http://10.0.0.1:20001", "/v1/completions", KEY)
    assert upstream.target("http://10.0.0.1:20001", "/v1/completions", KEY) is target
    assert target.head == head
    # A new key (a replaced replica on the same address) gets its own head.
    other = upstream.target("http://10.0.0.1:20001", "/v1/completions", KEY[::-1])
    assert other is not target and KEY[::-1].encode() in other.head


def test_an_endpoint_key_must_be_header_safe() -> None:
    for bad in ("short", KEY + "\r\nX-Evil: 1", KEY + " x"):
        with pytest.raises(ValueError):
            wire.Endpoint(replica_id="r", url="http://h:1", engine_key=bad)
    assert KEY not in repr(wire.Endpoint(replica_id="r", url="http://h:1", engine_key=KEY))
