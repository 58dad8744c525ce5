"""Each injectable fault, seen from a client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable

import aiohttp
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.sim.helpers import StartEngine, params, until

from llmgw.errors import ValidationError
from llmgw.sim import tokens
from llmgw.sim.core import check_params

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me"}]


def client_for(url: str, timeout: float = 10.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)


async def test_fail_at_start_health_503_then_500_forever(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", ready=False, startup_s=0.2, fault="fail_at_start")
    async with aiohttp.ClientSession() as http:
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 503
        assert await engine.wait_ready() is False
        assert await asyncio.wait_for(engine.wait_exit(), 1) == 1
        assert engine.state == "failed"
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 500
    async with client_for(engine.url) as client:
        with pytest.raises(openai.InternalServerError, match="failed at start"):
            await client.chat.completions.create(model="m", messages=CHAT)


async def test_crash_mid_stream_drops_after_n_tokens(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", fault="crash_mid_stream", crash_after_tokens=3)
    async with client_for(engine.url) as client:
        received: list[str] = []
        stream = await client.chat.completions.create(
            model="m",
            messages=CHAT,
            max_tokens=10,
            stream=True,
        )
        with pytest.raises(openai.APIConnectionError):
            async for chunk in stream:
                for choice in chunk.choices:
                    assert choice.finish_reason is None, "a crashed stream never finishes"
                    if choice.delta.content:
                        received.append(choice.delta.content)
        assert "".join(received) == tokens.filler_text(3)
        with pytest.raises(openai.APIConnectionError):
            await client.completions.create(model="m", prompt="x", max_tokens=10)
    # The dropped requests gave their KV blocks back.
    await asyncio.sleep(0.05)
    assert engine.core.running == 0 and engine.core.kv.used_blocks == 0


async def test_hang_accepts_and_never_answers_while_healthy(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", fault="hang")
    async with aiohttp.ClientSession() as http, http.get(engine.url + "/health") as resp:
        assert resp.status == 200
    async with client_for(engine.url, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(model="m", prompt="x", max_tokens=2)
        assert time.monotonic() - started >= 0.3
    # Stopping a hung engine does not wait on its hung requests for long.
    async with client_for(engine.url, timeout=10) as client:
        pending = asyncio.create_task(client.completions.create(model="m", prompt="x"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await engine.stop()
        assert time.monotonic() - started < 2
        with pytest.raises(openai.APIConnectionError):
            await pending


async def test_slow_is_ten_times_slower(sim_engine: StartEngine) -> None:
    normal = await sim_engine("m", decode_ms_per_token=2.0, prefill_tokens_per_s=100_000.0)
    slow = await sim_engine(
        "m", decode_ms_per_token=2.0, prefill_tokens_per_s=100_000.0, fault="slow"
    )
    prompt = tokens.filler_text(2000)  # 20 ms of prefill at normal speed
    durations = []
    for engine in (normal, slow):
        async with client_for(engine.url) as client:
            started = time.monotonic()
            await client.completions.create(model="m", prompt=prompt, max_tokens=10)
            durations.append(time.monotonic() - started)
    # Modelled: 20 ms + 9 x 2 ms = 38 ms normal, 380 ms slow.
    assert durations[1] >= 0.38
    assert durations[1] > 5 * durations[0]


class Reading:
    """A streamed completion of 100 tokens read in the background, its chunks counted."""

    def __init__(self, stream: AsyncIterable[object]) -> None:
        self.chunks = 0
        self.task = asyncio.create_task(self._read(stream))

    @classmethod
    async def start(cls, client: openai.AsyncOpenAI) -> Reading:
        return cls(await client.completions.create(
            model="m", prompt="x", max_tokens=100, stream=True))  # fmt: skip

    async def _read(self, stream: AsyncIterable[object]) -> None:
        async for _ in stream:
            self.chunks += 1


async def test_hang_after_wedges_health_and_everything_else(sim_engine: StartEngine) -> None:
    engine = await sim_engine("m", hang_after_s=0.3, decode_ms_per_token=50.0)
    short = aiohttp.ClientTimeout(total=0.3)
    async with aiohttp.ClientSession() as http, client_for(engine.url, timeout=10) as client:
        async with http.get(engine.url + "/health", timeout=short) as resp:
            assert resp.status == 200
        # A request running when the engine wedges gets no further.
        reading = await Reading.start(client)
        await until(lambda: engine.state == "hung", within_s=2)
        await asyncio.sleep(0.2)
        stalled_at = reading.chunks
        await asyncio.sleep(0.3)
        assert reading.chunks == stalled_at and 0 < stalled_at < 100
        for path in ("/health", "/v1/models", "/metrics"):
            with pytest.raises(TimeoutError):
                async with http.get(engine.url + path, timeout=short):
                    pass
        started = time.monotonic()
        await engine.stop()
        assert time.monotonic() - started < 2
        with pytest.raises(openai.APIConnectionError):
            await reading.task


async def test_stall_after_freezes_progress_while_health_and_metrics_answer(
    sim_engine: StartEngine,
) -> None:
    engine = await sim_engine("m", stall_after_s=0.3, decode_ms_per_token=20.0)
    short = aiohttp.ClientTimeout(total=0.5)

    async def running_and_tokens() -> tuple[float, float, float]:
        async with http.get(engine.url + "/metrics", timeout=short) as resp:
            assert resp.status == 200
            lines = (await resp.text()).splitlines()
        value = {ln.split("{")[0]: float(ln.split()[-1]) for ln in lines if ln.startswith("vllm:")}
        return (
            value["vllm:num_requests_running"],
            value["vllm:generation_tokens_total"],
            value["vllm:prompt_tokens_total"],
        )

    async with aiohttp.ClientSession() as http, client_for(engine.url, timeout=10) as client:
        reading = await Reading.start(client)
        await until(lambda: engine.stalled, within_s=2)
        await asyncio.sleep(0.1)
        stalled_at = reading.chunks
        frozen = await running_and_tokens()
        await asyncio.sleep(0.3)
        # The request still counts as running; no token, no counter moves.
        assert reading.chunks == stalled_at and 0 < stalled_at < 100
        assert await running_and_tokens() == frozen
        assert frozen[0] == 1 and frozen[1] > 0
        assert engine.state == "ready" and engine.stats()["stalled"] is True
        async with http.get(engine.url + "/health", timeout=short) as resp:
            assert resp.status == 200
        await engine.stop()
        with pytest.raises(openai.APIConnectionError):
            await reading.task


def test_hang_after_needs_an_engine_that_becomes_ready() -> None:
    with pytest.raises(ValidationError, match=r"hang_after_s.*fail_at_start"):
        check_params(params(fault="fail_at_start", hang_after_s=1.0))
    with pytest.raises(pydantic.ValidationError, match="hang_after_s"):
        params(hang_after_s=-1.0)
    with pytest.raises(ValidationError, match=r"stall_after_s.*fail_at_start"):
        check_params(params(fault="fail_at_start", stall_after_s=1.0))
    with pytest.raises(pydantic.ValidationError, match="stall_after_s"):
        params(stall_after_s=float("inf"))
