"""Prefix routing end to end: affinity, agreement between gateways, the load guard."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, fast_settings, make_config, route, running_gateway
from tests.waiting import eventually

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


async def test_second_prompt_of_a_new_group_goes_where_the_first_is_prefilling(
    upstreams: Any,
) -> None:
    # The engines answer after 0.5 s; the gateway's prior says 1,000 prompt
    # tokens a second, so the ~450-token system prompt is ~0.45 s of prefill.
    # Blocks of 16 characters: all but a few tokens of it match, whatever
    # the first one's queue has counted down when the second is picked.
    slow = [await upstreams(f"e{i}", delay_s=0.5) for i in range(2)]
    link = MemoryLink(make_config(1, [route("m", slow)]), poll_timeout_s=1.0)
    settings = fast_settings(prefill_tokens_per_s=1000.0, prefix_block_chars=16)
    async with running_gateway(link, settings) as (gateway, url):
        client = async_client(url)

        async def ask(question: str) -> str:
            answer = await client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "system", "content": _system_prompt(2)},
                    {"role": "user", "content": question},
                ],
            )
            return answer.choices[0].message.content or ""

        first = asyncio.create_task(ask("first"))
        snapshot = gateway.snapshot
        assert snapshot is not None
        await eventually(
            lambda: any(r.in_flight for r in snapshot.replicas.values()), 1,
            what="a request in flight",
        )
        # The first is still in prefill: its engine computes the group's
        # prefix, and the second prompt, about as soon there as on the idle
        # engine, goes there rather than compute the prefix a second time.
        second = await ask("second")
        first_at = await first
        assert second == first_at
        assert await ask("third") == first_at
        text = gateway.metrics.render().decode()
        assert 'llmgw_gateway_prefix_routing_total{model="m",outcome="hit"} 2.0' in text
        assert 'llmgw_gateway_prefix_routing_total{model="m",outcome="miss"} 1.0' in text


async def test_a_hot_prefix_spreads_once_its_holder_is_too_far_ahead(upstreams: Any) -> None:
    slow = [await upstreams(f"e{i}", delay_s=0.5) for i in range(2)]
    link = MemoryLink(make_config(1, [route("m", slow)]), poll_timeout_s=1.0)
    async with running_gateway(link, fast_settings(load_threshold=2.0)) as (gateway, url):
        client = async_client(url)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": _system_prompt(1)},
            {"role": "user", "content": "same question"},
        ]
        warm = await client.chat.completions.create(model="m", messages=messages)
        holder = warm.choices[0].message.content
        answers = await asyncio.gather(
            *(client.chat.completions.create(model="m", messages=messages) for _ in range(8))
        )
        where = [a.choices[0].message.content for a in answers]
        # Wholly cached on the holder, so its estimate stays 0 however many
        # wait there: the in-flight spread (2) is what shares them out --
        # holder, holder, holder, other, holder, other, holder, other.
        assert where.count(holder) == 5, where
        text = gateway.metrics.render().decode()
        assert 'llmgw_gateway_prefix_routing_total{model="m",outcome="overloaded"} 3.0' in text
