"""Turns at an engine that computes one request at a time (gateway/routing/turns.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from llmgw.gateway.routing.turns import MAX_PASSED, Turns


@dataclass
class Routed:
    hashes: list[int]


async def _queue(
    turns: Turns, costs: list[float], picks: list[Routed | None] | None = None
) -> tuple[list[int], list[asyncio.Task[float]]]:
    """Requests of ``costs`` waiting behind one at the engine; the order their turns came in."""
    order: list[int] = []
    routed = picks or [None] * len(costs)

    async def request(index: int, cost: float) -> float:
        waited = await turns.take(cost, routed[index])
        order.append(index)
        return waited

    tasks = [asyncio.create_task(request(i, cost)) for i, cost in enumerate(costs)]
    await asyncio.sleep(0)
    return order, tasks


async def _serve(turns: Turns, count: int) -> None:
    """The engine finishing one request after another, ``count`` times."""
    for _ in range(count):
        turns.release()
        await asyncio.sleep(0)
        await asyncio.sleep(0)


def test_the_cheapest_waiting_prompt_goes_next_and_none_is_passed_over_without_bound() -> None:
    async def main() -> list[int]:
        turns = Turns()
        assert await turns.take(640.0) == 0.0  # at the engine
        # A cold prompt, then cached ones behind it.
        order, tasks = await _queue(turns, [640.0, 25.0, 30.0, 25.0, 20.0])
        await _serve(turns, 5)
        await asyncio.gather(*tasks)
        turns.release()
        assert not turns.busy and not turns.waiting
        return order

    order = asyncio.run(main())
    # The cheapest first (ties in arrival order), the cold one passed over MAX_PASSED times only.
    assert order[:MAX_PASSED] == [4, 1] and order[MAX_PASSED] == 0
    assert sorted(order) == [0, 1, 2, 3, 4]


def test_no_prompt_goes_before_an_earlier_one_that_computes_its_prefix() -> None:
    # A tenant's question waits cold (the index forgot its context), another
    # tenant's held one behind it, then the first tenant's next question,
    # estimated held because the first recorded the context at its send.
    # Sent first, that one would compute the context itself, as a "hit",
    # ahead of the other tenant's real hit.
    context = [hash(("ctx", i)) for i in range(8)]
    cold = Routed([*context, 1])
    other = Routed([hash(("other", i)) for i in range(9)])
    second = Routed([*context, 2])

    async def main() -> list[int]:
        turns = Turns()
        await turns.take(640.0)
        order, tasks = await _queue(turns, [640.0, 30.0, 20.0], [cold, other, second])
        await _serve(turns, 3)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [1, 0, 2]
    # Prompts that share less than half their blocks pass each other by cost.
    other.hashes = context[:3] + other.hashes[3:]
    second.hashes = context[:3] + [hash(("third", i)) for i in range(6)]
    assert asyncio.run(main()) == [2, 1, 0]


def test_a_lone_request_takes_the_turn_at_once_and_frees_it() -> None:
    async def main() -> None:
        turns = Turns()
        assert await turns.take(100.0) == 0.0
        assert turns.busy
        turns.release()
        assert not turns.busy
        assert await turns.take(100.0) == 0.0

    asyncio.run(main())


@pytest.mark.parametrize("granted", [False, True])
def test_a_waiter_that_leaves_loses_nothing_for_the_others(granted: bool) -> None:
    async def main() -> list[int]:
        turns = Turns()
        await turns.take(1.0)
        order, tasks = await _queue(turns, [1.0, 2.0])
        if granted:
            turns.release()  # the first one's turn comes...
        tasks[0].cancel()  # ...as its client leaves (or before)
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        if not granted:
            turns.release()
        assert await tasks[1] >= 0.0  # the turn passed on either way
        turns.release()
        assert not turns.busy and not turns.waiting
        return order

    assert asyncio.run(main()) == [1]
