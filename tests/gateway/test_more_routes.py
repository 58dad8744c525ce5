"""/v1/responses, /v1/rerank, /v1/score and /v1/audio/transcriptions through the gateway.

Real simulated engines over HTTP, the official openai client where it has
the route (responses, transcriptions) and httpx where it has not (rerank,
score). Each route: auth and the key's models, the envelope check (400 with
``param``), only replicas whose engine declares the route (404 otherwise,
also for an on-demand model whose replica turns out not to serve it), the
model's name as the engine knows it (JSON and multipart), usage metered from
the answer, and streams relayed whole.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from tests.gateway.conftest import (
    SECRET,
    assert_route_not_served,
    async_client,
    fast_settings,
    make_config,
    running_gateway,
)
from tests.gateway.sims import stub_engine

from llmgw import wire
from llmgw.gateway.app import Gateway
from llmgw.gateway.link import MemoryLink
from llmgw.sim.engine import SimEngine
from llmgw.sim.tokens import random_words

FAST = wire.SimParams(startup_s=0.0, decode_ms_per_token=0.2, prefill_tokens_per_s=1e6)
AUTH = {"Authorization": f"Bearer {SECRET}"}
WAV = b"RIFF" + bytes(64_000)  # two seconds of "audio"


def _endpoint(engine: SimEngine, replica_id: str) -> wire.Endpoint:
    routes = engine.params.routes
    dialect = wire.EngineDialect(
        extra_routes=list(wire.EXTRA_ROUTES if routes is None else routes)
    )
    return wire.Endpoint(replica_id=replica_id, url=engine.url, dialect=dialect)


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, SimEngine]]:
    started = {
        "full": SimEngine("sim", FAST),
        "chat-only": SimEngine("sim", FAST.model_copy(update={"routes": []})),
    }
    for engine in started.values():
        await engine.start("127.0.0.1", 0)
        await engine.wait_ready()
    yield started
    for engine in started.values():
        await engine.stop()


def _config(engines: dict[str, SimEngine], version: int = 1) -> wire.GatewayConfig:
    full, chat_only = engines["full"], engines["chat-only"]
    return make_config(version, [
        # Clients say "m"; the engines know the model as "sim".
        wire.ModelRoute(name="m", aliases=["m-alias"], served_name="sim",
                        endpoints=[_endpoint(full, "r-full")]),
        wire.ModelRoute(name="chat", served_name="sim",
                        endpoints=[_endpoint(chat_only, "r-chat")]),
        wire.ModelRoute(name="mixed", served_name="sim",
                        endpoints=[_endpoint(full, "r-mixed-full"),
                                   _endpoint(chat_only, "r-mixed-chat")]),
    ])  # fmt: skip


@pytest.fixture
def link(engines: dict[str, SimEngine]) -> MemoryLink:
    """The link serving ``engines``' routes (:func:`_config`), as a gateway's here."""
    return MemoryLink(_config(engines), poll_timeout_s=1.0)


async def _usage(gateway: Gateway, link: MemoryLink, model: str) -> dict[str, int]:
    await gateway.flush_usage()
    totals = {"requests": 0, "prompt": 0, "completion": 0, "errors": 0}
    for record in link.usage:
        if record.model == model:
            totals["requests"] += record.requests
            totals["prompt"] += record.prompt_tokens
            totals["completion"] += record.completion_tokens
            totals["errors"] += record.errors
    return totals


async def test_responses_whole_and_streamed(link: MemoryLink) -> None:
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        answer = await client.responses.create(
            model="m-alias", input="Say hello.", instructions="Be brief.", max_output_tokens=5
        )
        assert answer.status == "completed" and answer.model == "sim"
        assert len(answer.output_text.split()) == 5
        assert answer.usage is not None and answer.usage.output_tokens == 5
        whole_prompt = answer.usage.input_tokens

        events = [e async for e in await client.responses.create(
            model="m", input=[{"role": "user", "content": "Count to three."}],
            max_output_tokens=3, stream=True)]  # fmt: skip
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 3
        final = events[-1].response  # type: ignore[union-attr]
        assert final.usage is not None and final.usage.output_tokens == 3
        stream_prompt = final.usage.input_tokens

        usage = await _usage(gateway, link, "m")
    assert usage == {"requests": 2, "prompt": whole_prompt + stream_prompt,
                     "completion": 8, "errors": 0}  # fmt: skip


async def test_rerank_and_score_meter_their_usage(link: MemoryLink) -> None:
    async with running_gateway(link) as (gateway, url), httpx.AsyncClient(
        base_url=f"{url}/v1", headers=AUTH, timeout=20
    ) as http:
        documents = ["Paris is in France.", "Horses eat hay.", "The capital of France is Paris."]
        ask = {"model": "m", "query": "capital of France?", "documents": documents, "top_n": 2}
        ranked = await http.post("/rerank", json=ask)
        assert ranked.status_code == 200, ranked.text
        body = ranked.json()
        assert len(body["results"]) == 2 and body["model"] == "sim"
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True)
        rerank_tokens = body["usage"]["total_tokens"]  # vLLM's shape: total only

        scored = await http.post("/score", json={
            "model": "m", "text_1": "capital of France?", "text_2": documents})  # fmt: skip
        assert scored.status_code == 200, scored.text
        assert [d["index"] for d in scored.json()["data"]] == [0, 1, 2]
        score_tokens = scored.json()["usage"]["prompt_tokens"]

        usage = await _usage(gateway, link, "m")
    assert usage == {"requests": 2, "prompt": rerank_tokens + score_tokens,
                     "completion": 0, "errors": 0}  # fmt: skip


async def test_transcription_form_is_passed_on_with_the_engines_model_name(
    link: MemoryLink,
) -> None:
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        # The sim engine refuses any model name but "sim": the gateway must
        # rewrite the form's model field from the alias, and nothing else.
        text = await client.audio.transcriptions.create(
            model="m-alias", file=("hello.wav", WAV, "audio/wav"), language="en"
        )
        assert text.text and len(text.text.split()) == len(WAV) // 4000
        plain = await client.audio.transcriptions.create(
            model="m", file=("hello.wav", WAV), response_format="text"
        )
        assert plain.strip() == text.text
        async with httpx.AsyncClient(timeout=20) as http:
            streamed = await http.post(
                f"{url}/v1/audio/transcriptions", headers=AUTH,
                data={"model": "m", "stream": "true", "stream_include_usage": "true"},
                files={"file": ("a.wav", WAV)},
            )  # fmt: skip
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        usage = await _usage(gateway, link, "m")
    # Whole answers report audio seconds, not tokens: requests with 0 tokens;
    # the stream's usage chunk has tokens.
    assert usage["requests"] == 3 and usage["errors"] == 0
    assert usage["completion"] == len(WAV) // 4000


async def test_routes_the_engine_lacks_get_404_and_mixed_models_use_only_fit_replicas(
    engines: dict[str, SimEngine], link: MemoryLink,
) -> None:
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        with pytest.raises(openai.NotFoundError) as refused:
            await client.responses.create(model="chat", input="hi")
        assert_route_not_served(refused, "/v1/responses")
        with pytest.raises(openai.NotFoundError):
            await client.audio.transcriptions.create(model="chat", file=("a.wav", WAV))
        # Chat itself is served there as ever.
        await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        before = engines["chat-only"].core.counters.finished
        async with httpx.AsyncClient(base_url=f"{url}/v1", headers=AUTH, timeout=20) as http:
            for _ in range(6):
                answer = await http.post("/score", json={
                    "model": "mixed", "text_1": "a", "text_2": ["b", "c"]})  # fmt: skip
                assert answer.status_code == 200, answer.text
        assert engines["chat-only"].core.counters.finished == before


async def test_on_demand_model_whose_replica_lacks_the_route_gets_404(
    engines: dict[str, SimEngine],
) -> None:
    chat_only = engines["chat-only"]
    cold = wire.ModelRoute(name="cold", served_name="sim", on_demand=True)
    link: MemoryLink

    async def start(model: str) -> None:
        await asyncio.sleep(0.1)
        warm = cold.model_copy(update={"endpoints": [_endpoint(chat_only, "r-cold")]})
        link.publish(make_config(2, [warm]))

    link = MemoryLink(make_config(1, [cold]), poll_timeout_s=1.0, on_demand=start)
    async with running_gateway(link) as (_, url), httpx.AsyncClient(timeout=20) as http:
        ask = {"model": "cold", "query": "q", "documents": ["d"]}
        answer = await http.post(f"{url}/v1/rerank", headers=AUTH, json=ask)
    assert answer.status_code == 404, answer.text
    assert "does not serve /v1/rerank" in answer.json()["error"]["message"]
    assert link.demands == ["cold"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": "m"}, "input"),
        ("/v1/responses", {"model": "m", "input": []}, "input"),
        ("/v1/responses", {"model": "m", "input": [{"role": "robot", "content": "x"}]},
         "input[0].role"),
        ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": "5"},
         "max_output_tokens"),
        ("/v1/rerank", {"model": "m", "query": "q"}, "documents"),
        ("/v1/rerank", {"model": "m", "query": "q", "documents": [1]}, "documents[0]"),
        ("/v1/score", {"model": "m", "text_1": "a", "text_2": 2}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b"}, "model"),
    ],
)  # fmt: skip
async def test_envelopes_are_checked_before_routing(
    link: MemoryLink, path: str, body: dict[str, Any], param: str
) -> None:
    async with running_gateway(link) as (_, url), httpx.AsyncClient(timeout=20) as http:
        answer = await http.post(f"{url}{path}", headers=AUTH, json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


async def test_transcription_forms_are_checked_and_capped(link: MemoryLink) -> None:
    settings = fast_settings(max_body_bytes=200_000)
    async with running_gateway(link, settings) as (_, url), httpx.AsyncClient(timeout=20) as http:
        post = f"{url}/v1/audio/transcriptions"
        no_file = await http.post(post, headers=AUTH, data={"model": "m"},
                                  files={"other": ("x", b"x")})  # fmt: skip
        assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
        as_text = await http.post(post, headers=AUTH, files={"model": (None, "m"),
                                                              "file": (None, "not a file")})
        assert as_text.status_code == 400 and "a file" in as_text.json()["error"]["message"]
        bad = await http.post(post, headers=AUTH, data={"model": "m", "temperature": "hot"},
                              files={"file": ("a.wav", WAV)})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        json_body = await http.post(post, headers=AUTH, json={"model": "m"})
        assert json_body.status_code == 400
        assert json_body.json()["error"]["code"] == "invalid_content_type"
        huge = await http.post(post, headers=AUTH, data={"model": "m"},
                               files={"file": ("big.wav", bytes(300_000))})  # fmt: skip
        assert huge.status_code == 413
        nobody = await http.post(post, data={"model": "m"}, files={"file": ("a.wav", WAV)})
        assert nobody.status_code == 401


async def test_a_responses_stream_cut_short_ends_with_an_error_event() -> None:
    """An engine whose stream stops before response.completed: the client is told, in the
    Responses API's own error event, and the request is metered as an error."""

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: response.created\ndata: {"type":"response.created",'
                         b'"sequence_number":0,"response":{"id":"r","status":"in_progress",'
                         b'"usage":null}}\n\n')  # fmt: skip
        await resp.write_eof()
        return resp

    async with stub_engine("/v1/responses", cut) as engine:
        route = wire.ModelRoute(name="m", served_name="m", endpoints=[
            wire.Endpoint(replica_id="r", url=engine)])  # fmt: skip
        link = MemoryLink(make_config(1, [route]), poll_timeout_s=1.0)
        async with running_gateway(link) as (gateway, url), httpx.AsyncClient(timeout=20) as http:
            answer = await http.post(f"{url}/v1/responses", headers=AUTH,
                                     json={"model": "m", "input": "x", "stream": True})
            assert answer.status_code == 200
            events = [b for b in answer.text.split("\n\n") if b]
            assert events[-1].startswith("event: error\n")
            assert '"code":"upstream_incomplete"' in events[-1]
            usage = await _usage(gateway, link, "m")
        assert usage["requests"] == 1 and usage["errors"] == 1


async def test_responses_are_routed_by_prefix_and_share_it_with_chat() -> None:
    """A conversation keeps to the replica holding its prompt, whichever API it uses."""
    engines = [SimEngine("sim", FAST) for _ in range(3)]
    for engine in engines:
        await engine.start("127.0.0.1", 0)
        await engine.wait_ready()
    route = wire.ModelRoute(name="m", served_name="sim", endpoints=[
        _endpoint(engine, f"r{i}") for i, engine in enumerate(engines)])  # fmt: skip
    link = MemoryLink(make_config(1, [route]), poll_timeout_s=1.0)
    rng = random.Random(3)
    systems = [random_words(rng, 300) for _ in range(3)]
    try:
        async with running_gateway(link) as (_, url):
            client = async_client(url)
            cached: list[int] = []
            for system in systems:
                # The first turn by chat, the next ones by the Responses API.
                await client.chat.completions.create(model="m", max_tokens=2, messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": random_words(rng, 10)}])  # fmt: skip
                for _ in range(2):
                    answer = await client.responses.create(
                        model="m", instructions=system, input=random_words(rng, 10),
                        max_output_tokens=2)  # fmt: skip
                    assert answer.usage is not None
                    cached.append(answer.usage.input_tokens_details.cached_tokens)
    finally:
        for engine in engines:
            await engine.stop()
    # Every Responses turn found its 300-token system prompt cached (16-token blocks).
    assert min(cached) >= 288, cached
