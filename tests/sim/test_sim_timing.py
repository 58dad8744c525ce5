"""The latency model: prefix hits cut TTFT, batches slow decode, queues are FIFO.

Wall-clock assertions compare ratios with wide margins, so a loaded 2-core
machine slows both sides alike instead of failing the test.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionSystemMessageParam
from tests.sim.helpers import StartEngine, params, until

from llmgw.sim import tokens
from llmgw.sim.core import EngineCore, Phase
from llmgw.sim.engine import SimEngine


def client_for(engine: SimEngine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)


async def ttft(client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> float:
    started = time.monotonic()
    stream = await client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=2,
        stream=True,
    )
    first: float | None = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    assert first is not None
    return first


async def test_cached_prefix_cuts_time_to_first_token(sim_engine: StartEngine) -> None:
    # 8,000 system tokens at 40,000 tokens/s: 200 ms cold, ~1 ms for the question.
    engine = await sim_engine("m", prefill_tokens_per_s=40_000.0, prefill_chunk_tokens=8192)
    rng = random.Random(3)
    system: ChatCompletionSystemMessageParam = {
        "role": "system",
        "content": tokens.random_words(rng, 8000),
    }
    async with client_for(engine) as client:
        cold = await ttft(client, [system, {"role": "user", "content": "first question"}])
        warm = await ttft(client, [system, {"role": "user", "content": "another question"}])
        other: ChatCompletionSystemMessageParam = {
            "role": "system",
            "content": tokens.random_words(rng, 8000),
        }
        cold_again = await ttft(client, [other, {"role": "user", "content": "first question"}])
    assert cold >= 0.2
    assert warm < cold / 4
    assert cold_again > 4 * warm


async def test_a_stream_says_nothing_until_prefill_is_done(sim_engine: StartEngine) -> None:
    # As vLLM does: even the role chunk waits for the first token. The gateway
    # takes the first chunk as the end of a replica's queued prefill.
    engine = await sim_engine("m", prefill_tokens_per_s=40_000.0, prefill_chunk_tokens=8192)
    system = tokens.random_words(random.Random(5), 8000)  # 200 ms of prefill
    async with client_for(engine) as client:
        started = time.monotonic()
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "q"}],
            max_tokens=2,
            stream=True,
        )
        first_chunk_s: float | None = None
        chunks = []
        async for chunk in stream:
            if first_chunk_s is None:
                first_chunk_s = time.monotonic() - started
            chunks.append(chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert first_chunk_s is not None and first_chunk_s >= 0.2


async def test_decode_slows_as_the_batch_grows(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", decode_ms_per_token=5.0, decode_batch_alpha=1.0)

    async def one(client: openai.AsyncOpenAI) -> None:
        await client.completions.create(model="m", prompt="x", max_tokens=21)

    async with client_for(engine) as client:
        started = time.monotonic()
        await one(client)
        alone = time.monotonic() - started  # 20 steps of 5 ms
        started = time.monotonic()
        await asyncio.gather(*(one(client) for _ in range(4)))
        together = time.monotonic() - started  # 20 steps of 5 x (1 + 3) ms
    assert alone >= 0.1
    assert together > 2.5 * alone


async def test_running_limit_queues_fifo_and_max_waiting_refuses(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", max_running=1, max_waiting=2, decode_ms_per_token=10.0)
    finished: list[int] = []

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        # 1 s of decoding each: the first must still run when the third
        # arrives, also on a loaded machine (at 60 ms it had finished once).
        await client.completions.create(model="m", prompt=f"request {i}", max_tokens=100)
        finished.append(i)

    async with client_for(engine) as client:
        tasks: list[asyncio.Task[None]] = []

        def queued() -> int:
            return engine.core.running + engine.core.waiting

        for i in range(3):
            tasks.append(asyncio.create_task(one(client, i)))
            await until(lambda: queued() == len(tasks))
        assert (engine.core.running, engine.core.waiting) == (1, 2)
        with pytest.raises(openai.InternalServerError, match="already waiting"):
            await client.completions.create(model="m", prompt="one too many", max_tokens=1)
        await asyncio.gather(*tasks)
    assert finished == [0, 1, 2]


async def test_time_factor_scales_every_duration(sim_engine: StartEngine) -> None:
    real = await sim_engine("m", decode_ms_per_token=10.0)
    fast = await sim_engine("m", decode_ms_per_token=10.0, time_factor=0.1)
    durations = []
    for engine in (real, fast):
        async with client_for(engine) as client:
            started = time.monotonic()
            await client.completions.create(model="m", prompt="x", max_tokens=31)
            durations.append(time.monotonic() - started)
    assert durations[0] >= 0.3
    assert durations[1] < durations[0] / 3


async def test_prefill_is_computed_in_chunks_fifo() -> None:
    """A long prompt ahead in the queue delays a short one by whole chunks."""

    async def first_tokens(chunk: int) -> tuple[float, float]:
        core = EngineCore(params(prefill_chunk_tokens=chunk, time_factor=0.01))
        runner = asyncio.create_task(core.run())
        try:
            long = core.submit(tokens.filler_text(1000).encode(), 1)
            short = core.submit(tokens.filler_text(10).encode(), 1)
            await until(lambda: long.finished and short.finished)
            assert long.phase is Phase.DONE and short.phase is Phase.DONE
            assert long.first_token_at is not None and short.first_token_at is not None
            return long.first_token_at, short.first_token_at
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    long_at, short_at = await first_tokens(2048)
    assert long_at == short_at, "one step holds both prompts"
    long_at, short_at = await first_tokens(500)
    assert short_at > long_at, "two full chunks of the long prompt come first"
