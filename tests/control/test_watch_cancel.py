"""A stop's cancel reaches a gateway's config watch even when a new table lands in the same turn.

The in-process gateway (``llmgw up``, ``serve`` with a gateway) and every
gateway's long poll wait in ``Gateways.watch``. Under Python 3.11's
asyncio.wait_for, a cancel that lands in the turn the routing version moves
is swallowed: the watch returns a config, and the watching loop goes round
again instead of stopping, which left a stop waiting on it (the same fault
as tests/control/test_wakeup_cancel.py's, in the reconcile loop).
"""

from __future__ import annotations

import asyncio

from tests.waiting import ends_with_cancel

from llmgw.control.plane import ControlPlane


async def _cancel_as_the_table_moves(cp: ControlPlane, settle_turns: int) -> bool:
    """One try: True when the watching loop ended with the cancel."""
    rounds = 0

    async def watch_loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await cp.gateways.watch(cp.state.routing_version, wait_s=10.0)

    task = asyncio.create_task(watch_loop())
    await asyncio.sleep(0.01)
    await cp.state.bump_routing()
    for _ in range(settle_turns):
        await asyncio.sleep(0)
    return await ends_with_cancel(task)


async def test_a_new_table_in_the_same_turn_does_not_swallow_the_cancel(cp: ControlPlane) -> None:
    # Where in the wake-up the cancel lands depends on how many turns the
    # wait takes to finish: every one of the first few is tried.
    for turns in range(6):
        assert await _cancel_as_the_table_moves(cp, turns), (
            f"the watching loop outlived its cancel (cancel {turns} turns after the new table)"
        )
