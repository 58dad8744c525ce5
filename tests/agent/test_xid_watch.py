"""The agent runs its discoverer's Xid watch: marks reach the report, the watch ends with it."""

from __future__ import annotations

import time

from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane

from llmgw.agent.discoverer import Discoverer
from llmgw.agent.discovery.fake import FakeGpu, FakeNvml


async def test_an_xid_reaches_the_report_and_the_watch_stops_with_the_agent(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-0", name="NVIDIA H100 80GB HBM3", memory_total_mib=81559)])
    discoverer = Discoverer(nvml=fake, ignored_xids={13})
    agent = make_agent("n1", inventory_provider=discoverer)
    report = await fake_cp.wait_for(lambda r: bool(r.inventory.devices))
    assert report.inventory.devices[0].healthy and discoverer.watching
    fake.deliver_xid(0, 119)
    report = await fake_cp.wait_for(lambda r: not r.inventory.devices[0].healthy)
    assert (
        report.inventory.devices[0].unhealthy_reasons[0].startswith("Xid 119 (GSP RPC timeout) at ")
    )
    began = time.monotonic()
    await agent.shutdown(stop_engines=True)
    assert not discoverer.watching
    assert time.monotonic() - began < 3.0
