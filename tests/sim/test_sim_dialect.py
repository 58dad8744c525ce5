"""The simulator's dialect switches, its tokenizer route and its cut_stream fault,
seen from a client: what the gateway's mending is tested against."""

from __future__ import annotations

import aiohttp
import openai
from tests.sim.helpers import StartEngine

from llmgw.sim import tokens

CHAT = [{"role": "user", "content": "tell me"}]


async def _events(url: str, body: dict[str, object]) -> list[bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
    return [e for e in raw.split(b"\n\n") if e]


async def test_switches_make_it_ignore_what_llama_cpp_server_ignores(
    sim_engine: StartEngine,
) -> None:
    faithful = await sim_engine("m")
    ignorant = await sim_engine("m", max_completion_tokens=False, stream_usage=False)
    body = {"model": "m", "messages": CHAT, "max_completion_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    told = await _events(faithful.url, body)
    assert b'"usage"' in told[-2] and told[-1] == b"data: [DONE]"
    deaf = await _events(ignorant.url, body)
    assert not any(b'"usage"' in e for e in deaf)  # no usage chunk
    assert sum(b'"content":"' in e for e in deaf) == 16 + 1  # its default, not 3 (+ role)
    assert b'"finish_reason":"length"' in deaf[-2] and deaf[-1] == b"data: [DONE]"


async def test_tokenize_counts_by_the_simulators_rule(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m")
    text = tokens.filler_text(5) + "é"
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + "/tokenize", json={"prompt": text}) as resp:
            answer = await resp.json()
        async with http.post(engine.url + "/tokenize", json={"input": text}) as resp:
            assert resp.status == 400
    assert answer["count"] == tokens.count_tokens(text) == len(answer["tokens"])


async def test_cut_stream_ends_cleanly_without_a_finish_reason(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", fault="cut_stream", crash_after_tokens=2)
    events = await _events(engine.url, {"model": "m", "messages": CHAT, "stream": True})
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"finish_reason":"' in e for e in events)
    assert sum(b'"content":"' in e for e in events) == 2 + 1  # the role chunk's "" too
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x") as client:
        stream = await client.chat.completions.create(model="m", messages=CHAT, stream=True)
        chunks = [c async for c in stream]  # what a client sees without the gateway
    assert all(c.choices[0].finish_reason is None for c in chunks)
