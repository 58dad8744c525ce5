"""An agent's /metrics, scraped from its real server, over the fake NVML discovery.

A card in MIG mode (instances labelled ``card/migN``, no utilisation, the
card's temperature and power), a whole card with utilisation, a card with
uncorrected ECC errors (unhealthy), a replica of a stub engine (state,
restarts) and a weights cache entry.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import httpx
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, fake_gpu_node, model
from tests.metrics_check import Scrape, parse_scrape, promtool_check
from tests.servers import free_port

from llmgw.agent.discoverer import Discoverer
from llmgw.wire import ReplicaState, WeightsSource

MIB = 1024 * 1024


async def scrape(port: int, token: str | None = None) -> Scrape:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_scrape(answer.text)


async def test_devices_replicas_and_weights_on_the_agents_metrics(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    agent = make_agent("n1", inventory_provider=Discoverer(nvml=fake_gpu_node()))
    report = await fake_cp.wait_for(lambda r: len(r.inventory.devices) == 4)
    devices = {d.label: d for d in report.inventory.devices}
    assert set(devices) == {"0/mig0", "0/mig1", "1", "2"}
    spec = model("sim", name="stub-model", weights=WeightsSource(kind="none"),
                 gpu_classes=["h100-80g"], start_timeout_s=30.0)
    fake_cp.assignments["n1"] = [assign(spec, [devices["1"]], generation=3)]
    await fake_cp.wait_state("r1", ReplicaState.READY)
    # One complete cache entry, as a fetch leaves it (meta.json per entry).
    entry = agent.weights.root / "cached-model"
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text(json.dumps({
        "model": "cached-model", "source": {"kind": "hf", "repo": "org/m"},
        "files": [{"path": "a.bin", "size": 1000, "sha256": "0" * 64},
                  {"path": "b.bin", "size": 234, "sha256": "1" * 64}],
    }))

    assert agent.server is not None
    metrics = await scrape(agent.server.port)

    assert metrics.by("llmgw_agent_info", "node", "version")[("n1", "0.1.0")] == 1
    assert metrics.value("llmgw_agent_reports_sent_total") >= 1
    utilisation = metrics.by("llmgw_agent_device_utilization_ratio", "device")
    assert utilisation == {"1": 0.37, "2": 0.0}  # none for MIG instances, never 0
    temperature = metrics.by("llmgw_agent_device_temperature_celsius", "device")
    assert temperature["0/mig0"] == temperature["0/mig1"] == 61  # the card's
    power = metrics.by("llmgw_agent_device_power_watts", "device")
    assert power["0/mig1"] == 210.5 and power["1"] == 120.0
    assert metrics.by("llmgw_agent_device_memory_total_bytes", "device", "class") == {
        ("0/mig0", "a100-80g-mig-3g.40gb"): 40192 * MIB,
        ("0/mig1", "a100-80g-mig-3g.40gb"): 40192 * MIB,
        ("1", "h100-80g"): 81559 * MIB,
        ("2", "h100-80g"): 81559 * MIB,
    }
    used = metrics.by("llmgw_agent_device_memory_used_bytes", "device")
    assert used["0/mig1"] == 200 * MIB and used["1"] == 2048 * MIB
    assert metrics.by("llmgw_agent_device_healthy", "device") == {
        "0/mig0": 1, "0/mig1": 1, "1": 1, "2": 0,
    }
    assert metrics.by("llmgw_agent_device_ecc_uncorrected_errors_total", "device")["2"] == 3
    states = metrics.by("llmgw_agent_replica_state", "replica", "model", "state")
    assert {k: v for k, v in states.items() if v} == {("r1", "stub-model", "ready"): 1}
    assert len(states) == len(ReplicaState)
    assert metrics.by("llmgw_agent_replica_restarts_total", "replica") == {"r1": 2}
    assert metrics.by("llmgw_agent_weights_cache_bytes", "model") == {"cached-model": 1234}
    promtool_check(metrics.text)


async def test_the_agents_metrics_take_the_metrics_token_not_the_peer_token(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    agent = make_agent("n1", metrics_token="m-secret")
    await fake_cp.wait_for(lambda r: True)
    assert agent.server is not None
    url = f"http://127.0.0.1:{agent.server.port}/metrics"
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(url)).status_code == 401
        peer = await client.get(url, headers={"Authorization": "Bearer peer-secret"})
        assert peer.status_code == 401
        # ... and the metrics token opens nothing but /metrics.
        manifest = await client.get(f"http://127.0.0.1:{agent.server.port}/agent/v1/weights/"
                                    "manifest?model=x",
                                    headers={"Authorization": "Bearer m-secret"})
        assert manifest.status_code == 401
    metrics = await scrape(agent.server.port, "m-secret")
    assert metrics.by("llmgw_agent_device_healthy", "device") == {
        "cpu0": 1, "cpu1": 1, "cpu2": 1, "cpu3": 1,
    }
    # CPU slots have no utilisation, temperature or power figure: none is written.
    assert metrics.samples("llmgw_agent_device_utilization_ratio") == []
    assert metrics.samples("llmgw_agent_device_temperature_celsius") == []


async def test_llmgw_agent_takes_the_metrics_token_file(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    (tmp_path / "metrics.token").write_text("file-token\n")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw.cli.main", "agent", "--control-plane", fake_cp.url,
        "--join-token", fake_cp.join_token, "--data-dir", str(tmp_path / "d"),
        "--name", "cli-node", "--server-port", str(port),
        "--metrics-token-file", str(tmp_path / "metrics.token"), "--log-level", "warning",
    )
    try:
        await fake_cp.wait_for(lambda r: r.node == "cli-node", within=30)
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/metrics")).status_code == 401
        metrics = await scrape(port, "file-token")
        assert metrics.by("llmgw_agent_info", "node", "version") == {("cli-node", "0.1.0"): 1}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
