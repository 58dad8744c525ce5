"""The hold queue of a saturated model (llmgw.gateway.admission): order, reserve, bounds.

The gate alone first (classes, fairness between teams, weights, the reserve,
a waiter that leaves), then through a real gateway in front of a fake engine
that takes one request at a time: what the engine receives, in which order,
and what a client past the queue's bounds is answered.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from tests.gateway.conftest import (
    SECRET,
    api_key,
    async_client,
    fast_settings,
    make_config,
    route,
    running_gateway,
)

from llmgw.gateway.admission import (
    RECENT_S,
    Admission,
    Gate,
    Ticket,
    reserve_of,
    slots_per_replica,
)
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.replies import ApiError

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def _gate(capacity: int, reserve: int = 0) -> Gate:
    gate = Gate()
    gate.resize(capacity, reserve, object())
    return gate


def _served(gate: Gate, tickets: list[Ticket], names: list[str]) -> list[str]:
    """Queue ``tickets`` behind a held slot, then free slots one by one: who got them."""
    futures = [gate.queue(t) for t in tickets]
    order: list[str] = []
    for _ in tickets:
        granted = [i for i, t in enumerate(tickets) if t.granted]
        assert len(granted) == 1, "one slot, one holder"
        order.append(names[granted[0]])
        gate.leave(tickets[granted[0]])
    assert all(f.done() for f in futures)
    return order


async def test_higher_classes_are_served_first() -> None:
    gate = _gate(1)
    first = Ticket("key:x", STANDARD, 1.0)
    assert gate.try_enter(first)
    tickets = [Ticket("key:b", BATCH, 1.0), Ticket("key:s", STANDARD, 1.0),
               Ticket("key:i", INTERACTIVE, 1.0), Ticket("key:b2", BATCH, 1.0)]  # fmt: skip
    futures = [gate.queue(t) for t in tickets]
    gate.leave(first)
    order = []
    while any(not f.done() for f in futures) or gate.in_use:
        holder = next(i for i, t in enumerate(tickets) if t.granted)
        order.append(tickets[holder].team)
        gate.leave(tickets[holder])
    assert order == ["key:i", "key:s", "key:b", "key:b2"]


async def test_a_team_that_floods_shares_its_class_with_one_that_does_not() -> None:
    gate = _gate(1)
    blocker = Ticket("team:a", STANDARD, 1.0)
    assert gate.try_enter(blocker)
    flood = [Ticket("team:a", STANDARD, 1.0) for _ in range(6)]
    for ticket in flood:
        gate.queue(ticket)
    late = [Ticket("team:b", STANDARD, 1.0) for _ in range(2)]
    for ticket in late:
        gate.queue(ticket)
    gate.leave(blocker)
    order = []
    everyone = flood + late
    while gate.in_use:
        holder = next(t for t in everyone if t.granted)
        order.append(holder.team)
        gate.leave(holder)
    # First come first served would put both of b's after a's six; fair
    # queueing alternates from the moment b waits.
    assert order[:4] == ["team:a", "team:b", "team:a", "team:b"]
    assert order.count("team:a") == 6


async def test_weights_share_a_class_in_proportion() -> None:
    gate = _gate(1)
    blocker = Ticket("team:x", INTERACTIVE, 1.0)
    assert gate.try_enter(blocker)
    heavy = [Ticket("team:heavy", STANDARD, 2.0) for _ in range(8)]
    light = [Ticket("team:light", STANDARD, 1.0) for _ in range(8)]
    for pair in zip(heavy, light, strict=True):
        for ticket in pair:
            gate.queue(ticket)
    gate.leave(blocker)
    order: list[str] = []
    while gate.in_use and len(order) < 9:
        holder = next(t for t in heavy + light if t.granted)
        order.append(holder.team)
        gate.leave(holder)
    assert order.count("team:heavy") == 6 and order.count("team:light") == 3


async def test_the_reserve_lets_a_newcomer_start_while_another_team_holds_the_rest() -> None:
    gate = _gate(4, reserve=1)
    flood = [Ticket("team:a", STANDARD, 1.0) for _ in range(6)]
    started = [gate.try_enter(t) or (gate.queue(t) and t.granted) for t in flood]
    assert started == [True, True, True, False, False, False]  # one slot kept
    newcomer = Ticket("team:b", STANDARD, 1.0)
    gate.queue(newcomer)
    assert newcomer.granted, "b's first request takes the reserved slot at once"
    gate.leave(newcomer)
    assert gate.in_use == 3, "and the slot is kept free again, not given to a's backlog"
    gate.leave(flood[0])
    assert not flood[3].granted, "b asked lately: one more slot is kept for its next request"
    gate.lately["team:b"] -= RECENT_S
    gate.leave(flood[1])
    assert flood[3].granted and flood[4].granted and gate.in_use == 3


async def test_a_light_team_in_flight_finds_a_slot_for_its_next_request() -> None:
    gate = _gate(8, reserve=1)
    flood = [Ticket("team:a", STANDARD, 1.0) for _ in range(12)]
    for ticket in flood:
        if not gate.try_enter(ticket):
            gate.queue(ticket)
    assert gate.held == {"team:a": 7}
    first = Ticket("team:b", STANDARD, 1.0)
    gate.queue(first)
    assert first.granted and gate.in_use == 8
    gate.leave(flood[0])  # a's next one waits: the slot is kept for b's next request
    assert gate.held == {"team:a": 6, "team:b": 1} and gate.in_use == 7
    second = Ticket("team:b", STANDARD, 1.0)
    gate.queue(second)
    assert second.granted
    gate.leave(first)
    gate.leave(second)  # b is done, but may ask again soon: its slot stays kept a while
    assert gate.held == {"team:a": 6}
    gate.lately["team:b"] -= RECENT_S  # b has not asked for a while
    gate.leave(flood[1])
    assert gate.held == {"team:a": 7}, "a gets all but the reserve again"


async def test_batch_never_takes_the_reserve() -> None:
    gate = _gate(4, reserve=1)
    batch = [Ticket(f"team:{n}", BATCH, 1.0) for n in "abcd"]
    assert [gate.try_enter(t) for t in batch] == [True, True, True, False]
    gate.queue(batch[3])
    assert not batch[3].granted, "a team of its own, but batch: the reserve stays"
    interactive = Ticket("team:e", INTERACTIVE, 1.0)
    assert gate.try_enter(interactive) is False  # someone waits: in line, not past it
    gate.queue(interactive)
    assert interactive.granted


async def test_a_waiter_that_leaves_gives_its_place_up() -> None:
    admission = Admission(queue_length=10, wait_s=5.0, reserve_share=0.0, retry_after_s=3)
    gate = admission.gate("m", 1, ["r1"], 1, object())
    holder = Ticket("key:a", STANDARD, 1.0)
    assert await admission.enter(gate, holder, "m") == 0.0
    waiter = asyncio.create_task(admission.enter(gate, Ticket("key:b", STANDARD, 1.0), "m"))
    await asyncio.sleep(0.01)
    assert gate.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.waiting == 0
    gate.leave(holder)
    assert gate.in_use == 0


async def test_bounded_wait_and_queue() -> None:
    admission = Admission(queue_length=1, wait_s=0.1, reserve_share=0.0, retry_after_s=3)
    gate = admission.gate("m", 1, ["r1"], 1, object())
    assert await admission.enter(gate, Ticket("key:a", STANDARD, 1.0), "m") == 0.0
    waiter = asyncio.create_task(admission.enter(gate, Ticket("key:b", STANDARD, 1.0), "m"))
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as full:
        await admission.enter(gate, Ticket("key:c", STANDARD, 1.0), "m")
    assert (full.value.status, full.value.code, full.value.retry_after) == (429, "queue_full", 3)
    with pytest.raises(ApiError) as late:
        await waiter
    assert (late.value.status, late.value.code, late.value.retry_after) == (503, "overloaded", 3)
    assert gate.waiting == 0 and gate.in_use == 1


def test_slot_arithmetic() -> None:
    assert slots_per_replica(8, 0) == 8  # gateways unknown yet: as if alone
    assert slots_per_replica(8, 3) == 3  # rounded up: 9 in all, not 6
    assert slots_per_replica(1, 4) == 1
    assert [reserve_of(c, 0.125) for c in (1, 2, 8, 16, 17)] == [0, 1, 1, 2, 2]
    assert reserve_of(8, 0.0) == 0


# -- through a gateway -------------------------------------------------------

_KEYS = {
    "batch": ("sk-llmgw-batch-key-0123456789abcdefghijklmnopq", "batch"),
    "interactive": ("sk-llmgw-inter-key-0123456789abcdefghijklmnopq", "interactive"),
}


def _keys() -> list[Any]:
    return [api_key(), *(api_key(secret, key_id=name, priority=cls)
                         for name, (secret, cls) in _KEYS.items())]  # fmt: skip


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not condition():  # noqa: ASYNC110 - a gauge, not an event
            await asyncio.sleep(0.01)


async def _ask(url: str, key: str, text: str) -> float:
    client = async_client(url, key)
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}]
    )
    return time.monotonic()


async def test_a_saturated_model_serves_the_interactive_key_before_the_batch_backlog(
    upstreams: Any, link: MemoryLink
) -> None:
    engine = await upstreams("e1", delay_s=0.15)
    link.publish(make_config(1, [route("m", [engine], max_concurrency=1)], _keys()))
    async with running_gateway(link, fast_settings(hold_reserve=0.0)) as (_, url):
        batch_key = _KEYS["batch"][0]
        backlog = [asyncio.create_task(_ask(url, batch_key, f"batch {n}")) for n in range(4)]
        await asyncio.sleep(0.05)  # the first batch request runs, three wait
        urgent = asyncio.create_task(_ask(url, _KEYS["interactive"][0], "urgent"))
        await asyncio.gather(*backlog, urgent)
    order = [s.body["messages"][0]["content"] for s in engine.seen]
    assert order == ["batch 0", "urgent", "batch 1", "batch 2", "batch 3"]
    # The engine never ran two at once.
    starts = [s.at for s in engine.seen]
    assert all(b - a >= 0.14 for a, b in itertools.pairwise(starts))


async def test_without_a_cap_the_engine_gets_everything_at_once(
    upstreams: Any, link: MemoryLink
) -> None:
    engine = await upstreams("e1", delay_s=0.15)
    link.publish(make_config(1, [route("m", [engine])], _keys()))
    async with running_gateway(link) as (_, url):
        batch_key = _KEYS["batch"][0]
        await asyncio.gather(*(_ask(url, batch_key, f"batch {n}") for n in range(4)))
    starts = [s.at for s in engine.seen]
    assert max(starts) - min(starts) < 0.1


async def test_past_the_bounds_the_client_is_told_when_to_come_back(
    upstreams: Any, link: MemoryLink
) -> None:
    engine = await upstreams("e1", delay_s=1.5)
    link.publish(make_config(1, [route("m", [engine], max_concurrency=1)], _keys()))
    settings = fast_settings(hold_wait_s=0.6, hold_queue_length=1, retry_after_s=7)
    async with running_gateway(link, settings) as (gateway, url):
        running = asyncio.create_task(_ask(url, SECRET, "runs"))
        await _until(lambda: gateway.metrics.model("m").in_flight == 1)
        waiting = asyncio.create_task(_ask(url, SECRET, "waits"))
        await _until(lambda: gateway.metrics.held() == {"m": 1})
        with pytest.raises(openai.RateLimitError) as full:
            await _ask(url, SECRET, "no room")
        assert full.value.response.headers["retry-after"] == "7"
        assert full.value.code == "queue_full"
        with pytest.raises(openai.InternalServerError) as late:
            await waiting
        assert late.value.status_code == 503
        assert late.value.response.headers["retry-after"] == "7"
        assert late.value.code == "overloaded"
        assert gateway.metrics.held() == {}
        await running
    assert [s.body["messages"][0]["content"] for s in engine.seen] == ["runs"]
