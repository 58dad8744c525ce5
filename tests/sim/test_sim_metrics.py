"""vLLM-named metrics that move while requests run, in parseable Prometheus text."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families
from tests.sim.helpers import StartEngine
from tests.waiting import eventually

from llmgw.sim import tokens
from llmgw.sim.engine import SimEngine


async def scrape(http: aiohttp.ClientSession, engine: SimEngine) -> dict[str, float]:
    """Sample name -> value, for the unlabelled-by-bucket samples."""
    async with http.get(engine.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == "m"
            if "le" not in sample.labels:
                out[sample.name] = sample.value
    return out


async def test_metrics_follow_running_waiting_kv_and_prefix_hits(
    sim_engine: StartEngine,
) -> None:
    # Slow decode and two slots: three requests give 2 running and 1 waiting.
    engine = await sim_engine("m", max_running=2, decode_ms_per_token=20.0)
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    rng = random.Random(7)
    prompts = [tokens.random_words(rng, 64) for _ in range(3)]
    async with aiohttp.ClientSession() as http, client:
        idle = await scrape(http, engine)
        assert idle["vllm:num_requests_running"] == 0
        assert idle["vllm:num_requests_waiting"] == 0
        assert idle["vllm:kv_cache_usage_perc"] == 0
        assert idle["vllm:prefix_cache_queries_total"] == 0

        calls = [
            asyncio.create_task(client.completions.create(model="m", prompt=p, max_tokens=15))
            for p in prompts
        ]
        async def two_running_one_waiting() -> dict[str, float] | None:
            seen = await scrape(http, engine)
            running, waiting = seen["vllm:num_requests_running"], seen["vllm:num_requests_waiting"]
            return seen if (running, waiting) == (2, 1) else None

        busy = await eventually(two_running_one_waiting, 1, what="2 running, 1 waiting",
                                every_s=0.01)  # fmt: skip
        assert busy["vllm:num_requests_running"] == 2
        assert busy["vllm:num_requests_waiting"] == 1
        # Two requests of 64 + 15 tokens pin ceil(79/16) = 5 blocks each.
        assert busy["vllm:kv_cache_usage_perc"] == 10 / engine.params.kv_blocks
        await asyncio.gather(*calls)
        after = await scrape(http, engine)
        assert after["vllm:prefix_cache_hits_total"] == 0
        await client.completions.create(model="m", prompt=prompts[0], max_tokens=15)

        done = await scrape(http, engine)
        assert done["vllm:num_requests_running"] == 0
        assert done["vllm:num_requests_waiting"] == 0
        assert done["vllm:kv_cache_usage_perc"] == 0
        assert done["vllm:prefix_cache_queries_total"] == 4 * 64
        # The repeat found 3 of its 4 blocks cached (the block holding the last
        # prompt token is always recomputed).
        assert done["vllm:prefix_cache_hits_total"] == 48
        assert done["vllm:generation_tokens_total"] == 4 * 15
        assert done["vllm:request_success_total"] == 4
        assert done["vllm:time_to_first_token_seconds_count"] == 4
        assert done["vllm:time_to_first_token_seconds_sum"] > 0


async def test_metrics_answer_during_start_up(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", ready=False, startup_s=5.0)
    async with aiohttp.ClientSession() as http:
        values = await scrape(http, engine)
    assert values["vllm:num_requests_running"] == 0
