"""A request for an on-demand model wakes the reconciler before the demand is written.

The pass reads demand from memory; waiting for the store write first put two
transactions in front of every cold start (bench/coldstart.py measured
20-100 ms of it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmgw.control.plane import ControlPlane
from llmgw.wire import ModelSpec


async def test_the_reconciler_is_woken_while_the_demand_is_still_being_written(
    cp: ControlPlane,
) -> None:
    await cp.catalog.put([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"],
                                   min_replicas=0, max_replicas=1)])
    await cp.wait_for_wakeup(0.01)  # the catalog change's wake-up, consumed
    release = asyncio.Event()
    real = cp.writes.upsert_models

    async def slow_write(*args: Any, **kwargs: Any) -> None:
        await release.wait()
        await real(*args, **kwargs)

    cp.writes.upsert_models = slow_write  # type: ignore[method-assign]
    demand = asyncio.create_task(cp.catalog.demand("m"))
    # The write is held: the pass must be free to start anyway.
    await asyncio.wait_for(cp.wait_for_wakeup(5.0), 2.0)
    assert not demand.done()
    assert cp.state.models["m"].demand_at is not None
    release.set()
    await asyncio.wait_for(demand, 5.0)
    stored = {row["name"]: row for row in await cp.store.list_models()}
    assert stored["m"]["demand_at"] == cp.state.models["m"].demand_at
