"""A stop's cancel reaches a reconcile loop even when a wake-up lands in the same turn.

On Python 3.11, asyncio.wait_for returns normally when the awaited event is
set in the loop turn that cancels the waiter: the reconcile loop then went on
ticking after the runtime's stop() cancelled it, and stop() waited on it for
ever (a full suite run hung 300 s in test_runtime_stepdown that way).
"""

from __future__ import annotations

import asyncio

from tests.waiting import ends_with_cancel

from llmgw.control.plane import ControlPlane


async def test_a_wake_up_in_the_same_turn_does_not_swallow_the_cancel(cp: ControlPlane) -> None:
    turns = 0

    async def reconcile_like() -> None:
        nonlocal turns
        while True:
            turns += 1
            await cp.wait_for_wakeup(10.0)

    loop_task = asyncio.create_task(reconcile_like())
    await asyncio.sleep(0.01)
    cp.wake_reconciler()
    await asyncio.sleep(0)  # the wait on the event completes in this turn
    assert await ends_with_cancel(loop_task), f"the loop outlived its cancel ({turns} turns)"
