"""Requests held while a model has no ready replica.

Each model has one :class:`asyncio.Event` that the config watcher sets when a
config arrives in which the model has an endpoint; every waiter wakes in the
same loop iteration, so the hold adds no polling delay beyond the config's own
arrival. The event is replaced after it fires, so later waiters wait for the
next change instead of seeing a stale "set".

The queue is bounded per model: one cold model must not let a burst of clients
pin thousands of sockets (and a busy model's memory) while nothing can serve.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable


class WaitRoom:
    def __init__(self, max_waiting: int) -> None:
        self._max = max_waiting
        self._events: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}

    def full(self, model: str) -> bool:
        return self._waiting.get(model, 0) >= self._max

    def waiting(self) -> dict[str, int]:
        return {model: n for model, n in self._waiting.items() if n}

    def enter(self, model: str) -> bool:
        """Count one waiter in; True when it is the first (the one that asks for a replica)."""
        count = self._waiting.get(model, 0)
        self._waiting[model] = count + 1
        return count == 0

    def leave(self, model: str) -> None:
        count = self._waiting.get(model, 0) - 1
        if count > 0:
            self._waiting[model] = count
        else:
            self._waiting.pop(model, None)

    async def wait(self, model: str, deadline: float) -> bool:
        """Wait for the next config change that gives ``model`` an endpoint.

        False when ``deadline`` (time.monotonic()) passes first.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        event = self._events.get(model)
        if event is None:
            event = self._events[model] = asyncio.Event()
        try:
            async with asyncio.timeout(remaining):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def wake(self, models: Iterable[str]) -> None:
        for model in models:
            event = self._events.pop(model, None)
            if event is not None:
                event.set()
