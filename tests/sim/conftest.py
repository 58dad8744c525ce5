"""Fixtures of the sim tests: simulated engines on loopback, stopped afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from tests.sim.helpers import StartEngine, engine_in_thread, params

from llmgw.sim.engine import SimEngine


@pytest.fixture
async def sim_engine() -> AsyncIterator[StartEngine]:
    """``await sim_engine(model="m", ready=True, **params)`` -> a started engine."""
    started: list[SimEngine] = []

    async def start(model: str = "sim", ready: bool = True, **overrides: Any) -> SimEngine:
        engine = SimEngine(model, params(**overrides))
        started.append(engine)
        await engine.start("127.0.0.1", 0)
        if ready:
            assert await engine.wait_ready()
        return engine

    try:
        yield start
    finally:
        await asyncio.gather(*(e.stop() for e in started))


@pytest.fixture
def threaded_engine() -> Iterator[SimEngine]:
    with engine_in_thread("sim") as engine:
        yield engine
