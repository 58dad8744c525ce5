"""On-demand models: the first request asks for a replica and waits for it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, fast_settings, make_config, route, running_gateway
from tests.waiting import eventually

from llmgw.gateway.link import MemoryLink


async def test_first_request_starts_the_model_and_is_answered(upstreams: Any) -> None:
    engine = await upstreams("cold")
    published_at: list[float] = []
    link = MemoryLink(poll_timeout_s=1.0)
    # The engine "loads" until the test has seen every request waiting: a fixed
    # load time raced the five clients' arrival on a busy machine.
    loaded = asyncio.Event()

    async def start_replica(model: str) -> None:
        async def later() -> None:
            await loaded.wait()
            published_at.append(time.monotonic())
            link.publish(make_config(2, [route(model, [engine], on_demand=True)]))

        asyncio.get_running_loop().create_task(later())

    link.on_demand = start_replica
    link.publish(make_config(1, [route("lazy", [], on_demand=True)]))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)

        async def ask(i: int) -> str:
            answer = await client.chat.completions.create(
                model="lazy", messages=[{"role": "user", "content": f"hi {i}"}]
            )
            return answer.choices[0].message.content or ""

        tasks = [asyncio.create_task(ask(i)) for i in range(5)]
        await eventually(lambda: gateway.runtime.room.waiting() == {"lazy": 5}, 10)
        assert gateway.runtime.room.waiting() == {"lazy": 5}
        # The waiting count reaches the control plane with the load reports.
        await eventually(lambda: any(r.waiting == {"lazy": 5} for r in link.loads), 10)
        assert any(report.waiting == {"lazy": 5} for report in link.loads)
        loaded.set()
        answers = await asyncio.gather(*tasks)
        assert answers == ["hello from cold"] * 5
        assert link.demands == ["lazy"]  # asked once, not once per request
        # Event-driven wake-up: requests reach the engine right after the config
        # (about a millisecond here; the bound leaves room for a busy CI machine,
        # and a polling design with any useful interval would still fail it).
        first_seen = min(seen.at for seen in engine.seen)
        assert first_seen - published_at[0] < 0.1 * 2.5
        assert gateway.runtime.room.waiting() == {}


async def test_wait_times_out_with_503_and_full_queue_is_429(link: MemoryLink) -> None:
    link.publish(make_config(1, [route("lazy", [], on_demand=True)]))
    settings = fast_settings(queue_wait_s=0.5, queue_length=2, retry_after_s=3)
    async with running_gateway(link, settings) as (gateway, url):
        client = async_client(url)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        waiting = [
            asyncio.create_task(client.chat.completions.create(model="lazy", messages=messages))
            for _ in range(2)
        ]
        await eventually(lambda: gateway.runtime.room.waiting() == {"lazy": 2},
                         what="the queue full", every_s=0.005)  # fmt: skip
        with pytest.raises(openai.RateLimitError) as full:
            await client.chat.completions.create(model="lazy", messages=messages)
        assert full.value.response.headers["retry-after"] == "3"
        began = time.monotonic()
        for task in waiting:
            with pytest.raises(openai.InternalServerError) as timed_out:
                await task
            assert timed_out.value.status_code == 503
            assert timed_out.value.code == "model_not_ready"
            assert timed_out.value.response.headers["retry-after"] == "3"
        assert time.monotonic() - began < 1.0


async def test_parked_model_is_refused_at_once(link: MemoryLink) -> None:
    parked = route("broken", [], on_demand=True, parked=True, parked_reason="3 failed starts")
    link.publish(make_config(1, [parked]))
    async with running_gateway(link) as (_, url):
        with pytest.raises(openai.InternalServerError) as refused:
            await async_client(url).chat.completions.create(
                model="broken", messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 503
        assert "3 failed starts" in refused.value.message
        assert link.demands == []


async def test_requests_wait_out_the_loss_of_the_only_replica(upstreams: Any) -> None:
    # The model's one replica is gone (its node died: connections refused);
    # the control plane publishes a replacement a moment later. Requests sent
    # meanwhile fail over to it instead of failing with 503.
    replacement = await upstreams("replacement")
    dead = "http://127.0.0.1:9"  # the discard port: refused
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [route("lazy", [dead], on_demand=True)]))
    published: list[float] = []

    async def replace(model: str) -> None:
        async def later() -> None:
            await asyncio.sleep(0.5)  # the replacement starts elsewhere
            published.append(time.monotonic())
            link.publish(make_config(2, [route(model, [replacement], on_demand=True)]))

        if not published:
            asyncio.get_running_loop().create_task(later())

    link.on_demand = replace
    async with running_gateway(link, fast_settings(queue_wait_s=10.0)) as (gateway, url):
        client = async_client(url)

        async def ask(i: int) -> str:
            await asyncio.sleep(i * 0.05)
            answer = await client.chat.completions.create(
                model="lazy", messages=[{"role": "user", "content": f"hi {i}"}]
            )
            return answer.choices[0].message.content or ""

        answers = await asyncio.gather(*(ask(i) for i in range(8)))
        assert answers == ["hello from replacement"] * 8
        assert link.demands[:1] == ["lazy"]
        dead_replica = gateway.snapshot.replicas.get(dead)  # type: ignore[union-attr]
        assert dead_replica is None  # gone with the new config
        # Nothing reached the replacement before it was published, and the
        # waiting requests reached it right after.
        assert min(seen.at for seen in replacement.seen) >= published[0]
        assert min(seen.at for seen in replacement.seen) - published[0] < 0.25
