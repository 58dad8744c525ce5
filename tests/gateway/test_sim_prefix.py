"""Prefix routing against simulated engines with real (simulated) prefix caches.

The engines report ``cached_tokens`` from their own KV caches, so this checks
the point of prefix routing, not its mechanics: with the same requests, the
engines find far more of the prompts already cached than under round-robin.
"""

from __future__ import annotations

import random

from tests.gateway.conftest import api_key, async_client, running_gateway

from llmgw import wire
from llmgw.gateway.link import MemoryLink
from llmgw.sim.engine import SimEngine
from llmgw.sim.tokens import random_words

GROUPS = 6
ROUNDS = 4


async def _start_engines() -> list[SimEngine]:
    # 80 blocks of 16 tokens: room for about three of the 400-token system
    # prompts per engine, so round-robin (every engine sees all six) thrashes.
    started = []
    for _ in range(3):
        engine = SimEngine(
            "sim",
            wire.SimParams(startup_s=0.0, decode_ms_per_token=0.5, prefill_tokens_per_s=1e6,
                           kv_blocks=80, block_tokens=16),
        )  # fmt: skip
        await engine.start("127.0.0.1", 0)
        await engine.wait_ready()
        started.append(engine)
    return started


async def _cached_tokens(
    policy: wire.RoutingPolicy, gateways: int = 0, kv: int = 32768
) -> tuple[int, str]:
    """Prompt tokens the engines found cached over the run, and the gateway's metrics after it."""
    engines = await _start_engines()
    try:
        return await _run(engines, policy, gateways, kv)
    finally:
        for engine in engines:
            await engine.stop()


async def _run(
    engines: list[SimEngine], policy: wire.RoutingPolicy, gateways: int, kv: int = 32768
) -> tuple[int, str]:
    route = wire.ModelRoute(
        name="m", served_name="sim", routing=policy,
        endpoints=[wire.Endpoint(replica_id=f"r{i}", url=e.url, kv_capacity_tokens=kv)
                   for i, e in enumerate(engines)],
    )  # fmt: skip
    rng = random.Random(7)
    systems = [random_words(rng, 400) for _ in range(GROUPS)]
    order = [(r, g) for r in range(ROUNDS) for g in range(GROUPS)]
    rng.shuffle(order)
    cached = 0
    # gateways: what the routing table says of them (0: not known, 1: this one alone).
    table = wire.RoutingTable(version=1, models=[route], gateways=gateways)
    config = wire.GatewayConfig(routing=table, keys=[api_key()])
    async with running_gateway(MemoryLink(config, poll_timeout_s=1.0)) as (gateway, url):
        client = async_client(url)
        for round_, group in order:
            answer = await client.chat.completions.create(
                model="m",
                max_tokens=2,
                messages=[
                    {"role": "system", "content": systems[group]},
                    {"role": "user", "content": f"question {round_} {random_words(rng, 20)}"},
                ],
            )
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            cached += answer.usage.prompt_tokens_details.cached_tokens or 0
        metrics = gateway.metrics.render().decode()
        snapshot = gateway.snapshot
        assert snapshot is not None
        learnt.clear()
        learnt["chars_per_token"] = snapshot.speeds["m"].chars_per_token
        for replica in snapshot.routes["m"].replicas:
            learnt[replica.replica_id] = replica.capacity_scale
    return cached, metrics


# What the last run's gateway learnt from the engines' usage (see _run).
learnt: dict[str, float] = {}


async def test_prefix_routing_finds_more_cached_prompt_than_round_robin() -> None:
    with_prefix, _ = await _cached_tokens("prefix")
    with_round_robin, _ = await _cached_tokens("round-robin")
    # 24 requests of ~420 tokens: prefix routing misses each group once.
    assert with_prefix >= 0.6 * (GROUPS * (ROUNDS - 1) * 400)
    assert with_prefix > 2 * with_round_robin, (with_prefix, with_round_robin)


async def test_a_lone_gateway_finds_as_much_cached_prompt() -> None:
    # A lone gateway places a prompt whose first block it has not seen by
    # load, from that block alone, and hashes the whole prompt only once the
    # answer has started: what it records then must send the group's next
    # prompts back to the engine that cached it.
    lone, metrics = await _cached_tokens("prefix", gateways=1)
    assert lone >= 0.6 * (GROUPS * (ROUNDS - 1) * 400), lone
    # Found by the index, not by the luck of hash placement on idle engines
    # (which alone keeps a group on one engine while all are idle): most of
    # each group's later prompts were routed as hits. Not all: a prompt
    # right after its group's previous one can come before the gateway has
    # recorded that one (LEARN_AFTER_S after its first token).
    outcomes = {
        outcome: float(line.rsplit(" ", 1)[1])
        for outcome in ("hit", "miss")
        for line in metrics.splitlines()
        if line.startswith(f'llmgw_gateway_prefix_routing_total{{model="m",outcome="{outcome}"}}')
    }
    assert outcomes.get("hit", 0) >= GROUPS * (ROUNDS - 1) / 2, outcomes
    assert outcomes.get("hit", 0) + outcomes.get("miss", 0) == GROUPS * ROUNDS, outcomes


async def test_engine_usage_teaches_the_index_what_the_engines_hold() -> None:
    # Replicas configured with KV for 300 tokens (the index then holds less
    # than one group's prompt) on engines that hold about three groups: the
    # engines' token counts give the characters per token, their reports of
    # cached tokens on prompts the gateway placed as new grow the index until
    # it keeps the groups the engines keep.
    cached, _ = await _cached_tokens("prefix", gateways=1, kv=300)
    assert 3.5 < learnt["chars_per_token"] < 4.5, learnt
    assert max(learnt[f"r{i}"] for i in range(3)) > 1.0, learnt
    assert cached >= 0.6 * (GROUPS * (ROUNDS - 1) * 400), cached
