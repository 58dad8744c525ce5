"""Helpers for the sim tests: fast parameters and an engine on a thread's loop.

An engine on a loop in a thread lets a *sync* client block without freezing
the server it talks to.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.waiting import eventually

from llmgw.sim.engine import SimEngine
from llmgw.wire import SimParams

# Fast defaults: no start-up wait, 1 ms per decode step, quick prefill.
FAST = {"startup_s": 0.0, "decode_ms_per_token": 1.0, "prefill_tokens_per_s": 200_000.0}

StartEngine = Callable[..., Awaitable[SimEngine]]


def params(**overrides: Any) -> SimParams:
    return SimParams(**{**FAST, **overrides})


@contextmanager
def engine_in_thread(model: str = "sim", **overrides: Any) -> Iterator[SimEngine]:
    loop = asyncio.new_event_loop()
    engine_box: list[SimEngine] = []
    ready = threading.Event()

    async def boot() -> None:
        engine = SimEngine(model, params(**overrides))
        await engine.start("127.0.0.1", 0)
        await engine.wait_ready()
        engine_box.append(engine)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(boot(), loop).result(10)
    ready.wait(10)
    try:
        yield engine_box[0]
    finally:
        asyncio.run_coroutine_threadsafe(engine_box[0].stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """``eventually``, polled every 2 ms: the timing tests read the moment it turns true."""
    await eventually(condition, within_s, every_s=0.002)
