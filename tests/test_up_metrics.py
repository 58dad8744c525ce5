"""`llmgw up --sim` (the real command) serves one /metrics: the gateway's and the control plane's.

A simulated fleet with MIG instances, an unhealthy card and a model that
cannot be placed; the scrape must carry both parts' families, take the
metrics token from the environment, agree with the summary taken around it,
and pass promtool's lint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from tests.metrics_check import Scrape, parse_scrape, promtool_check
from tests.servers import llmgw_up
from tests.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLEET = """\
fabrics: [ib-a]
nodes:
  - {count: 2, class: a100-80g, gpus: 2, fabric: ib-a, unhealthy: 1,
     mig: {cards: 1, profile: 3g.40gb, instances: 2}}
  - {count: 1, class: h100-80g, gpus: 2, fabric: ib-a}
models:
  - {name: sim-chat, engine: sim, gpu_classes: [a100-80g-mig-3g.40gb],
     min_replicas: 2, max_replicas: 2, sim: {startup_s: 0.2}}
  - {name: sim-huge, engine: sim, gpu_classes: [h100-80g], gpus: 4, tp: 4, min_replicas: 1}
"""
TOKEN = "llmgw-metrics-test"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("upmetrics")
    (root / "fleet.yaml").write_text(FLEET)
    async with llmgw_up(root, "--sim", str(root / "fleet.yaml"),
                        env={"LLMGW_METRICS_TOKEN": TOKEN}) as running:  # fmt: skip
        yield running.info["admin_url"], running.info["admin_token"]


async def test_up_serves_both_parts_on_one_metrics(up: tuple[str, str]) -> None:
    url, admin_token = up
    admin = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.get("/metrics")).status_code == 401

        async def summary() -> Any:
            return (await client.get("/admin/v1/summary", headers=admin)).json()

        seen: list[Any] = []

        async def chat_ready() -> bool:
            seen[:] = [await summary()]
            return bool(seen[0].get("replicas", {}).get("ready") == 2)

        await eventually(chat_ready, 40, what="2 ready sim-chat replicas", note=lambda: seen)

        async def steady_scrape() -> tuple[Any, Scrape] | None:
            # The fleet lives in another process and may move between two
            # reads: take the summary on both sides of the scrape.
            before = await summary()
            answer = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 200, answer.text
            after = await summary()
            return (after, parse_scrape(answer.text)) if before == after else None

        fleet, metrics = await eventually(steady_scrape, 40, what="a steady fleet")

    names = set(metrics.families)
    assert {"llmgw_gateway_requests", "llmgw_gateway_overhead_seconds",
            "llmgw_control_reconcile_pass_seconds", "llmgw_control_agent_reports",
            "llmgw_control_store_write_seconds", "llmgw_fleet_devices"} <= names
    assert metrics.value("llmgw_control_leader") == 1
    assert metrics.by("llmgw_control_agent_reports_total", "outcome")["accepted"] >= 3
    assert metrics.by("llmgw_control_reconcile_passes_total", "outcome")["ok"] >= 1
    assert metrics.by("llmgw_fleet_nodes", "state") == {
        s: fleet["nodes"][s] for s in ("ready", "cordoned", "draining", "unreachable")
    }
    assert metrics.by("llmgw_fleet_devices", "class", "state") == {
        (use["class"], state): use[state]
        for use in fleet["gpus"] for state in ("used", "free", "unhealthy")
    }
    assert metrics.by("llmgw_fleet_devices", "class", "state")[
        ("a100-80g-mig-3g.40gb", "used")] == 2
    assert metrics.by("llmgw_fleet_replicas", "state") == fleet["replicas"]
    assert metrics.value("llmgw_fleet_models_unplaceable") == len(fleet["unplaceable"]) == 1
    assert metrics.by("llmgw_model_unplaceable", "model") == {"sim-huge": 1}
    assert metrics.by("llmgw_model_replicas", "model", "state")[("sim-chat", "ready")] == 2
    promtool_check(metrics.text)
