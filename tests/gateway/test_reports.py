"""Load reports to the control plane: per replica, batched, counts not lost."""

from __future__ import annotations

import time
from typing import Any

from tests.gateway.conftest import async_client, make_config, route, running_gateway
from tests.waiting import eventually

from llmgw.gateway.link import MemoryLink


async def test_load_reports_carry_requests_and_last_request_time(
    upstreams: Any, link: MemoryLink
) -> None:
    engines = [await upstreams("e1"), await upstreams("e2")]
    link.publish(make_config(1, [route("m", engines, routing="round-robin")]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        before = time.time()
        for _ in range(6):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        # All six counted, then two more reports: a request counted twice would show.
        await eventually(lambda: sum(load.requests for r in link.loads for load in r.replicas) >= 6,
                         what="six requests reported")  # fmt: skip
        sent = len(link.loads)
        await eventually(lambda: len(link.loads) >= sent + 2, what="two more reports")
    reported: dict[str, int] = {}
    last: dict[str, float] = {}
    for report in link.loads:
        assert report.gateway_id
        for load in report.replicas:
            reported[load.replica_id] = reported.get(load.replica_id, 0) + load.requests
            if load.last_request_at is not None:
                last[load.replica_id] = load.last_request_at
            # One request at a time: a report may land while one is running.
            assert load.in_flight in (0, 1)
    # Reports sent after the last answer see nothing in flight.
    assert all(load.in_flight == 0 for load in link.loads[-1].replicas)
    # Each request is counted in exactly one report, however many were sent.
    assert reported == {"e1": 3, "e2": 3}
    assert all(before <= at <= time.time() for at in last.values()) and len(last) == 2
    assert len(link.loads) >= 2
