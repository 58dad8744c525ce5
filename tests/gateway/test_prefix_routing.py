"""Prefix routing end to end: affinity, agreement between gateways, the load guard."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, fast_settings, make_config, route, running_gateway

from llmgw.gateway.link import MemoryLink


def _system_prompt(group: int) -> str:
    rng = random.Random(group)
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(300))  # ~1.8 kB, ~7 blocks


async def test_two_gateways_send_a_repeated_prefix_to_the_same_replica(upstreams: Any) -> None:
    engines = [await upstreams(f"e{i}") for i in range(3)]
    config = make_config(1, [route("m", engines)])
    link_a, link_b = MemoryLink(config, poll_timeout_s=1.0), MemoryLink(config, poll_timeout_s=1.0)
    async with running_gateway(link_a) as (_, url_a), running_gateway(link_b) as (gw_b, url_b):
        clients = [async_client(url_a), async_client(url_b)]
        placed: dict[int, set[str]] = {}
        for round_ in range(3):
            for group in range(12):
                client = clients[(group + round_) % 2]  # each group alternates gateways
                answer = await client.chat.completions.create(
                    model="m",
                    messages=[
                        {"role": "system", "content": _system_prompt(group)},
                        {"role": "user", "content": f"question {round_}"},
                    ],
                )
                placed.setdefault(group, set()).add(answer.choices[0].message.content or "")
        # Every group stayed on one replica, though two gateways with no shared
        # state saw its first requests...
        assert all(len(where) == 1 for where in placed.values()), placed
        # ...and the groups were spread over the replicas, not piled on one.
        assert len({next(iter(where)) for where in placed.values()}) == 3
        metrics = gw_b.metrics.render().decode()
        assert 'llmgw_gateway_prefix_routing_total{model="m",outcome="hit"}' in metrics


async def test_overloaded_holder_loses_to_the_least_loaded(upstreams: Any) -> None:
    slow = [await upstreams(f"e{i}", delay_s=0.5) for i in range(2)]
    link = MemoryLink(make_config(1, [route("m", slow)]), poll_timeout_s=1.0)
    async with running_gateway(link, fast_settings(load_threshold=2.0)) as (gateway, url):
        client = async_client(url)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": _system_prompt(1)},
            {"role": "user", "content": "same question"},
        ]
        answers = await asyncio.gather(
            *(client.chat.completions.create(model="m", messages=messages) for _ in range(8))
        )
        where = [a.choices[0].message.content for a in answers]
        # Identical prompts, but the holder got at most threshold + 1 ahead of the other.
        assert 3 <= where.count("hello from e0") <= 5, where
        text = gateway.metrics.render().decode()
        assert 'outcome="overloaded"' in text
