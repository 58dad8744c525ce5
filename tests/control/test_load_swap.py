"""A reload of the fleet from the store never shows a half-read fleet.

A standby reloads every few seconds (and a new leader once): with the
tables cleared before the store's rows were read, every request answered
during those reads (the admin API, the summary, the console) saw no nodes,
models or replicas (tests/control/test_standby.py caught a GET in that window
on a loaded machine).
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmgw.control.plane import ControlPlane
from llmgw.control.state import ModelRecord
from llmgw.wire import ModelSpec


async def test_the_fleet_stays_whole_while_its_rows_are_read(cp: ControlPlane) -> None:
    spec = ModelSpec(name="m", engine="sim")
    cp.state.models["m"] = ModelRecord(spec=spec, created_at=0.0, updated_at=0.0)
    reading, go_on = asyncio.Event(), asyncio.Event()
    list_replicas = cp.store.list_replicas

    async def slow_list_replicas() -> Any:
        reading.set()
        await go_on.wait()
        return await list_replicas()

    cp.store.list_replicas = slow_list_replicas  # type: ignore[method-assign]
    load = asyncio.create_task(cp.load())
    async with asyncio.timeout(5):
        await reading.wait()
    # Mid-read: what the fleet was, not an empty one.
    assert list(cp.state.models) == ["m"]
    go_on.set()
    await load
    # Then what the store holds (nothing was written to it here).
    assert list(cp.state.models) == []
