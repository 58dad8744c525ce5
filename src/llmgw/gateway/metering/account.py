"""Metering one answer: the key's and team's limits, the usage rows, the model's token counters.

Every answer is metered exactly once, whatever its route and however it
ended (a stream that broke or was cut is metered with what the client
received: it was generated). A stream counted by the gateway is metered
when its count is done; one the client did not want usage for is counted
after its answer ended, off the client's time (:func:`count_later`), and a
clean stop waits for those counts (:func:`settle_counts`).
"""

from __future__ import annotations

import asyncio
import time

from llmgw.gateway.call import Call
from llmgw.gateway.metering.counter import METER_TIMEOUT_S, StreamCounter
from llmgw.gateway.metering.tally import StreamTally
from llmgw.gateway.metering.usage import Usage


def account(call: Call, usage: Usage | None, error: bool) -> None:
    """Meter an answer: the key's and team's limits, the usage rows, the token counters."""
    usage = usage or Usage()
    record = call.record
    if usage.prompt or usage.completion:
        snapshot = call.rt.snapshot
        router = snapshot.routes.get(call.model) if snapshot is not None else None
        price = router.route.price if router is not None else None
        call.rt.tenancy.charge(record, price, usage.prompt, usage.completion)
    minute = int(time.time()) // 60 * 60
    call.rt.usage.add(
        minute, record.key_id, call.model, usage.prompt, usage.completion, usage.cached, error
    )
    counters = call.counters
    counters.prompt += usage.prompt
    counters.completion += usage.completion
    counters.cached += usage.cached
    prefill = call.prefill
    if prefill is not None and usage.prompt and not error:
        prefill.metered(usage.prompt, usage.cached)


_later: set[asyncio.Task[None]] = set()


async def settle_counts(timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) for streams still being counted, so a stop meters them."""
    if _later:
        await asyncio.wait(set(_later), timeout=timeout_s)


def count_later(call: Call, counter: StreamCounter, tally: StreamTally, failed: bool) -> None:
    """Count a stream the client did not want usage for after its answer ended, and meter it."""

    async def count() -> None:
        usage, _ = await counter.usage(tally, METER_TIMEOUT_S, waited_for=False)
        account(call, usage, failed)

    task = asyncio.get_running_loop().create_task(count())
    _later.add(task)
    task.add_done_callback(_later.discard)
