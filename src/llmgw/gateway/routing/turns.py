"""Turns at an engine that computes one request at a time: this gateway's queue for it.

Such an engine (llama_cpp.server: one lock around the model) serves what it
is sent in the order it came, so a prompt it has cached (a 25-token
prefill, ~0.2 s) waits behind another's cold one (~3 s) sent a moment
earlier. The gateway sends it one request at a time instead and holds the
rest here, where the order can be chosen: the one with the fewest prompt
tokens left to compute (the routing's estimate) goes next. A request passed
over MAX_PASSED times goes next whatever it costs, so none waits without
bound behind a stream of cheaper ones. None passes an earlier one sharing
half its prompt or more: the prefix is recorded on the replica at the send,
so the later one's estimate counts held what only the earlier one's prefill
may compute (bench/routing_real.py, seed 1: a tenant's second question,
counted held from the first one's send, went before it and before another
tenant's hit; the first, counted cold, went last). On
bench/routing_real_replay.py's workload (12 seeds, engines 1.5x the
reference's time) TTFT p50 fell from 2.00 to 1.56 s and p90 from 5.80 to
5.43 s, hit rate unchanged; with short queues nothing changes. The price:
the engine idles one round trip between requests, where it had the next
one queued already.

Each gateway (and worker) keeps its own turns: several of them send an
engine one request each at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

# How many later requests may go before a waiting one.
MAX_PASSED = 2


class Hashed(Protocol):
    """A routed prompt's chained block hashes (routing.policy.Pick), set by its send's record."""

    hashes: list[int]


class _Waiter:
    __slots__ = ("cost", "future", "passed", "pick")

    def __init__(self, cost: float, future: asyncio.Future[None], pick: Hashed | None) -> None:
        self.cost = cost
        self.future = future
        self.passed = 0
        self.pick = pick

    @property
    def blocks(self) -> Sequence[int]:
        return self.pick.hashes if self.pick is not None else ()


class Turns:
    """One replica's turns: whether a request of this gateway is at the engine, who waits."""

    __slots__ = ("busy", "waiting")

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[_Waiter] = []  # in arrival order

    async def take(self, cost: float, pick: Hashed | None = None) -> float:
        """Wait for the turn (``cost``: prompt tokens left to compute; ``pick``: the
        prompt's routing, None where it has none); the seconds waited.

        The caller owes a :meth:`release` once this returns (not when it
        raises: a waiter cancelled after its turn came passes it on).
        """
        if not self.busy:
            self.busy = True
            return 0.0
        loop = asyncio.get_running_loop()
        waiter = _Waiter(cost, loop.create_future(), pick)
        self.waiting.append(waiter)
        started = loop.time()
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # its turn came as it was cancelled
            else:
                self.waiting.remove(waiter)
            raise
        return loop.time() - started

    def release(self) -> None:
        """The engine is done with this gateway's request: the next one's turn."""
        waiting = self.waiting
        if not waiting:
            self.busy = False
            return
        waiter = waiting.pop(next_turn(waiting))
        waiter.future.set_result(None)  # busy stays: the turn is handed over


class Waiting(Protocol):
    cost: float
    passed: int

    @property
    def blocks(self) -> Sequence[int]: ...


def next_turn(waiting: Sequence[Waiting]) -> int:
    """Which of ``waiting`` (in arrival order, not empty) goes next; counts who it passes."""
    chosen = 0
    # Only ever the earlier ones are passed over, so the first has been the most.
    if waiting[0].passed < MAX_PASSED:
        for at in range(1, len(waiting)):
            if waiting[at].cost < waiting[chosen].cost and not _follows(waiting, at):
                chosen = at
    for earlier in waiting[:chosen]:
        earlier.passed += 1
    return chosen


def _follows(waiting: Sequence[Waiting], at: int) -> bool:
    """Whether a waiter before ``waiting[at]`` shares at least half of its prompt's blocks."""
    blocks = waiting[at].blocks
    if not blocks:
        return False
    half = (len(blocks) - 1) // 2
    # Chained hashes: equal at one block, equal up to it.
    mark = blocks[half]
    return any(len(w.blocks) > half and w.blocks[half] == mark for w in waiting[:at])
