"""The simulated engine's LoRA adapters and sleep mode, seen over HTTP as vLLM's are."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from tests.sim.helpers import StartEngine

CHAT = [{"role": "user", "content": "hello"}]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, str] | None = None
               ) -> tuple[int, str]:  # fmt: skip
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def test_adapters_load_into_slots_serve_by_name_and_unload(
    sim_engine: StartEngine, tmp_path: Path
) -> None:
    engine = await sim_engine("base", max_loras=2, max_lora_rank=8, lora_load_s=0.2)
    load, unload = engine.url + "/v1/load_lora_adapter", engine.url + "/v1/unload_lora_adapter"
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as http:
        began = time.monotonic()
        assert (await post(http, load, {"lora_name": "a", "lora_path": "/x/a"}))[0] == 200
        assert time.monotonic() - began >= 0.2  # the load takes its time
        assert (await post(http, load, {"lora_name": "b", "lora_path": "/x/b"}))[0] == 200
        again = await post(http, load, {"lora_name": "a", "lora_path": "/x/a"})
        assert again[0] == 400 and "already been loaded" in again[1]
        full = await post(http, load, {"lora_name": "c", "lora_path": "/x/c"})
        assert full[0] == 400 and "no free adapter slot" in full[1]
        async with http.get(engine.url + "/v1/models") as resp:
            cards = {c["id"]: c for c in (await resp.json())["data"]}
        assert cards["a"]["parent"] == "base" and cards["b"]["parent"] == "base"
        assert "parent" not in cards["base"]

        answer = await client.chat.completions.create(model="a", messages=CHAT, max_tokens=3)
        assert answer.model == "a"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="c", messages=CHAT, max_tokens=3)

        assert (await post(http, unload, {"lora_name": "a"}))[0] == 200
        assert (await post(http, unload, {"lora_name": "a"}))[0] == 404
        assert (await post(http, load, {"lora_name": "c", "lora_path": "/x/c"}))[0] == 200
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="a", messages=CHAT, max_tokens=3)
    assert (engine.lora.loads, engine.lora.unloads) == (3, 1)
    await client.close()


async def test_an_adapter_above_the_rank_limit_is_refused(
    sim_engine: StartEngine, tmp_path: Path
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 32}))
    engine = await sim_engine("base", max_loras=1, max_lora_rank=16, lora_load_s=0)
    async with aiohttp.ClientSession() as http:
        status, text = await post(http, engine.url + "/v1/load_lora_adapter",
                                  {"lora_name": "big", "lora_path": str(tmp_path)})
    assert status == 400 and "max_lora_rank 16" in text


async def test_an_engine_without_max_loras_has_no_adapter_routes(sim_engine: StartEngine) -> None:
    engine = await sim_engine("base")
    async with aiohttp.ClientSession() as http:
        status, _ = await post(http, engine.url + "/v1/load_lora_adapter",
                               {"lora_name": "a", "lora_path": "/x"})
        assert status == 404
        assert (await post(http, engine.url + "/sleep"))[0] == 404


async def test_sleep_refuses_completions_keeps_health_and_wakes_fast(
    sim_engine: StartEngine,
) -> None:
    # startup_s 2.0 is the cold start a wake (0.1 s) replaces.
    engine = await sim_engine("m", ready=False, startup_s=2.0, sleep_s=0.05, wake_s=0.1)
    assert await engine.wait_ready()
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as http:
        assert (await post(http, engine.url + "/sleep?level=1"))[0] == 200
        async with http.get(engine.url + "/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": True}
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 200  # asleep is not dead: the agent's probe must not kill it
        with pytest.raises(openai.InternalServerError, match="asleep"):
            await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
        began = time.monotonic()
        assert (await post(http, engine.url + "/wake_up"))[0] == 200
        woke = time.monotonic() - began
        async with http.get(engine.url + "/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": False}
    assert 0.1 <= woke < 1.0
    answer = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert answer.choices[0].message.content
    await client.close()


async def test_two_adapters_and_their_base_never_share_cached_prefix_blocks(
    sim_engine: StartEngine,
) -> None:
    engine = await sim_engine("base", max_loras=2, lora_load_s=0)
    long_prompt: Any = [{"role": "user", "content": "the same long prefix " * 80}]
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as http:
        for name in ("a", "b"):
            await post(http, engine.url + "/v1/load_lora_adapter",
                       {"lora_name": name, "lora_path": "/x"})  # fmt: skip
    cached = {}
    for model in ("a", "a", "b", "base"):
        answer = await client.chat.completions.create(model=model, messages=long_prompt,
                                                      max_tokens=2)  # fmt: skip
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.setdefault(model, []).append(details.cached_tokens if details else 0)
    await client.close()
    assert cached["a"][0] == 0 and (cached["a"][1] or 0) > 0  # a hits its own prefix
    assert cached["b"] == [0] and cached["base"] == [0]  # but nobody else's
