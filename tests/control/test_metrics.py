"""The control plane's /metrics, scraped from real servers on loopback.

The fleet gauges must equal the summary's figures (the console's test fleet:
MIG instances, an unhealthy card, an unreachable node, a parked and an
unplaceable model, an idle replica); the counters must move when their work
happens; ``llmgw up``/``serve`` must serve both parts' families on one
/metrics; and a scrape of a 2,000-node fleet must stay cheap.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.console.fleet import MIG_CLASS, build
from tests.control.planekit import bearer, opened_plane, running, served_plane
from tests.metrics_check import Scrape, parse_scrape, promtool_check
from tests.servers import free_port, serve_asgi
from tests.waiting import eventually

from llmgw.cli.combined import PathDispatcher, build_gateway
from llmgw.control.adminapi.patroni import PatroniReader
from llmgw.control.app import create_app
from llmgw.control.metrics import ControlCollector, fleet_families
from llmgw.control.plane import ControlPlane
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.scheduler.decide import decide
from llmgw.control.store.repo import Store
from llmgw.errors import NotLeaderError, StoreError
from llmgw.http.connection import LeanHttpProtocol
from llmgw.sim.fleetgen import generate
from llmgw.wire import EngineKind, ModelSpec, NodeState, ReplicaState

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Plane:
    cp: ControlPlane
    url: str
    admin: httpx.AsyncClient
    node_tokens: dict[str, str]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plane(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Plane]:
    async with opened_plane(tmp_path_factory.mktemp("metrics")) as (cp, creds):
        assert creds.admin_token and creds.join_token
        fleet = await build(cp, creds.join_token)
        async with (
            serve_asgi(create_app(cp)) as url,
            httpx.AsyncClient(base_url=url, headers=bearer(creds.admin_token), timeout=10) as admin,
        ):
            yield Plane(cp, url, admin, fleet.node_tokens)


async def scrape(url: str, token: str | None = None) -> Scrape:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(url + "/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_scrape(answer.text)


async def test_fleet_gauges_equal_the_summary(plane: Plane) -> None:
    summary = (await plane.admin.get("/admin/v1/summary")).json()
    metrics = await scrape(plane.url)

    assert metrics.by("llmgw_fleet_nodes", "state") == {
        state: float(summary["nodes"][state])
        for state in ("ready", "cordoned", "draining", "unreachable")
    }
    assert summary["nodes"]["unreachable"] == 1  # gpu-c1 never reported
    devices = metrics.by("llmgw_fleet_devices", "class", "state")
    expected = {}
    for use in summary["gpus"]:
        for state in ("used", "free", "unhealthy"):
            expected[(use["class"], state)] = float(use[state])
    assert devices == expected
    assert devices[(MIG_CLASS, "used")] == 1  # the idle chat replica on a MIG instance
    assert devices[("a100-80g", "unhealthy")] == 1
    assert metrics.by("llmgw_fleet_replicas", "state") == {
        state: float(n) for state, n in summary["replicas"].items()
    }
    assert metrics.by("llmgw_fleet_models", "status") == {
        "satisfied": summary["models"]["satisfied"],
        "short": summary["models"]["short"],
    }
    assert metrics.value("llmgw_fleet_models_unplaceable") == len(summary["unplaceable"]) >= 1
    assert metrics.value("llmgw_fleet_models_parked") == len(summary["parked"]) == 1
    assert metrics.value("llmgw_fleet_idle_replicas") == len(summary["idle_replicas"]) == 1

    # Per model: the same fold, so the sums are the totals and the names the lists.
    short = metrics.by("llmgw_model_short", "model")
    assert sum(short.values()) == summary["models"]["short"]
    assert len(metrics.by("llmgw_model_replicas_desired", "model")) == summary["models"]["total"]
    unplaceable = metrics.by("llmgw_model_unplaceable", "model")
    assert sorted(m for m, v in unplaceable.items() if v) == summary["unplaceable"]
    parked = metrics.by("llmgw_model_parked", "model")
    assert [m for m, v in parked.items() if v] == [p["model"] for p in summary["parked"]]
    assert metrics.by("llmgw_model_consecutive_failures", "model")["broken"] == 5
    by_state = metrics.by("llmgw_model_replicas", "model", "state")
    for state in ("ready", "starting", "draining", "failed"):
        assert sum(v for (_, s), v in by_state.items() if s == state) == summary["replicas"][state]


async def test_agent_reports_are_counted_by_outcome(plane: Plane) -> None:
    scraped = await scrape(plane.url)
    before = scraped.by("llmgw_control_agent_reports_total", "outcome")
    reads_before = scraped.by("llmgw_control_agent_report_reads_total", "path")
    node, token = next(iter(plane.node_tokens.items()))
    other = next(n for n in plane.node_tokens if n != node)
    report = {"node": node, "inventory": {"hostname": node}}
    async with httpx.AsyncClient(base_url=plane.url, timeout=10) as client:
        sends = [
            ({"Authorization": "Bearer nope"}, report, 401),
            ({"Authorization": f"Bearer {token}"}, {**report, "node": other}, 403),
            ({"Authorization": f"Bearer {token}"}, {"node": node, "inventory": 7}, 422),
            ({"Authorization": f"Bearer {token}"}, report, 200),
        ]
        for headers, body, status in sends:
            answer = await client.post("/agent/v1/report", json=body, headers=headers)
            assert answer.status_code == status, answer.text
        # The node's last report again, and it with a device's new reading.
        moved = {
            "node": node,
            "inventory": {
                "hostname": node,
                "devices": [
                    {
                        "number": 0,
                        "label": "0",
                        "uuid": "GPU-0",
                        "name": "H100",
                        "gpu_class": "h100-80g",
                        "temperature_c": 40,
                    }
                ],
            },
        }
        for body in (report, moved, moved):
            answer = await client.post(
                "/agent/v1/report", json=body, headers={"Authorization": f"Bearer {token}"}
            )
            assert answer.status_code == 200, answer.text
        moved["inventory"]["devices"][0]["temperature_c"] = 41  # type: ignore[index]
        answer = await client.post(
            "/agent/v1/report", json=moved, headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 200, answer.text
    metrics = await scrape(plane.url)
    after = metrics.by("llmgw_control_agent_reports_total", "outcome")
    for outcome in ("unauthorized", "wrong_node", "invalid"):
        assert after[outcome] - before.get(outcome, 0.0) == 1, outcome
    assert after["accepted"] - before.get("accepted", 0.0) == 5
    # The first and the changed inventory read whole; each repeated once as it was;
    # the last with a new temperature alone.
    reads = metrics.by("llmgw_control_agent_report_reads_total", "path")
    assert {path: reads[path] - reads_before.get(path, 0.0) for path in reads} == {
        "validated": 2,
        "same_bytes": 2,
        "telemetry": 1,
    }


async def test_passes_placements_store_writes_and_leadership(tmp_path: Path) -> None:
    async with served_plane(tmp_path) as (cp, creds, url):
        assert creds.join_token
        await build(cp, creds.join_token)
        # One more model that fits: the first pass places it.
        await cp.catalog.put(
            [
                ModelSpec(
                    name="extra", engine=EngineKind.SIM, gpu_classes=["a100-80g"], min_replicas=1
                )
            ]
        )
        async with running(cp, reconcile_interval_s=0.05) as runtime:
            assert cp.is_leader
            await wait_passes(runtime, 2)
            # Draining gpu-a1 moves its replicas make-before-break: placed as moves;
            # a replica whose engine failed is removed (and its model retried).
            await cp.nodes.set_state("gpu-a1", NodeState.DRAINING)
            cp.state.replicas["r-llama-1"].move_to(ReplicaState.FAILED, "engine exited (1)")
            await wait_passes(runtime, runtime.passes + 2)
            metrics = await scrape(url)
    assert metrics.value("llmgw_control_leader") == 1
    assert metrics.value("llmgw_control_leader_epoch") == cp.epoch >= 1
    passes = metrics.by("llmgw_control_reconcile_passes_total", "outcome")
    assert passes["ok"] >= 2
    assert metrics.value("llmgw_control_reconcile_pass_seconds_count") == sum(passes.values())
    assert metrics.value("llmgw_control_reconcile_pass_seconds_sum") > 0
    assert abs(metrics.value("llmgw_control_last_reconcile_timestamp_seconds") - time.time()) < 30
    placed = metrics.by("llmgw_control_replicas_placed_total", "reason")
    assert placed["short"] >= 1 and placed["move"] >= 1
    assert metrics.by("llmgw_control_replicas_removed_total", "reason")["failed"] == 1
    assert metrics.value("llmgw_control_store_write_seconds_count") >= 2
    assert metrics.by("llmgw_control_store_write_errors_total", "kind") == {}


async def wait_passes(runtime: ControlPlaneRuntime, count: int) -> None:
    await eventually(
        lambda: runtime.passes >= count,
        10,
        f"{count} reconcile passes",
        note=lambda: f"{runtime.passes} passes",
    )


async def test_store_write_errors_are_counted(tmp_path: Path) -> None:
    store = await Store.open("sqlite:///" + str(tmp_path / "cp.db"))
    try:
        epoch = await store.bump_epoch()
        with pytest.raises(NotLeaderError):
            async with store.fenced(epoch - 1):
                pass
        with pytest.raises(StoreError):
            async with store.transaction() as conn:
                await conn.exec_driver_sql("INSERT INTO no_such_table VALUES (1)")
    finally:
        await store.close()
    assert store.write_stats.errors == {"stale_epoch": 1, "error": 1}
    assert store.write_stats.seconds.counts[-1] == 0  # the bump was quick, and counted
    assert sum(store.write_stats.seconds.counts) == 1


@asynccontextmanager
async def _served_with_gateway(plane: Plane, *, open_metrics: bool = False) -> AsyncIterator[str]:
    """The control plane and a gateway on llmgw's server, as serve runs the two: its URL."""
    gateway = build_gateway(plane.cp, open_metrics=open_metrics)
    await gateway.start()
    try:
        dispatcher = PathDispatcher(create_app(plane.cp), gateway)
        async with serve_asgi(dispatcher, http=LeanHttpProtocol) as url:
            yield url
    finally:
        await gateway.stop()


async def test_up_and_serve_carry_both_parts_on_one_metrics(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_METRICS_TOKEN", "scrape-me")
    async with _served_with_gateway(plane) as url:
        async with httpx.AsyncClient(timeout=10) as client:
            refused = await client.get(url + "/metrics")
        assert refused.status_code == 401
        metrics = await scrape(url, "scrape-me")
    names = set(metrics.families)
    assert {
        "llmgw_gateway_requests",
        "llmgw_control_reconcile_pass_seconds",
        "llmgw_fleet_nodes",
        "llmgw_model_short",
    } <= names
    summary = (await plane.admin.get("/admin/v1/summary")).json()
    assert metrics.by("llmgw_fleet_nodes", "state")["ready"] == summary["nodes"]["ready"]
    promtool_check(metrics.text)


async def test_serve_and_up_metrics_want_the_admin_token_unless_opened(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /metrics shares serve's and up's port with /v1: without a metrics token
    # it is not open to whoever reaches that port, as the gateway's is not.
    monkeypatch.delenv("LLMGW_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("LLMGW_METRICS_TOKEN_FILE", raising=False)
    admin = plane.admin.headers["authorization"].removeprefix("Bearer ")
    node_token = next(iter(plane.node_tokens.values()))
    for opened in (False, True):
        async with _served_with_gateway(plane, open_metrics=opened) as url:
            async with httpx.AsyncClient(timeout=10) as client:
                bare = await client.get(url + "/metrics")
                by_node = await client.get(url + "/metrics",
                                           headers={"Authorization": f"Bearer {node_token}"})
            if opened:
                assert bare.status_code == 200
                continue
            assert bare.status_code == by_node.status_code == 401, bare.text
            assert "admin token" in bare.json()["error"]["message"]
            metrics = await scrape(url, admin)
            assert "llmgw_fleet_nodes" in metrics.families


async def test_control_plane_metrics_alone_take_the_metrics_token(plane: Plane) -> None:
    async with serve_asgi(create_app(plane.cp, metrics_token="t0k")) as url:
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(url + "/metrics")).status_code == 401
            wrong = await client.get(url + "/metrics", headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401
        metrics = await scrape(url, "t0k")
    promtool_check(metrics.text)


async def test_a_scrape_of_2000_nodes_stays_cheap() -> None:
    """Fleet gauges are folded per scrape: measure that fold at 2,000 nodes x 8 GPUs."""
    now = time.time()
    state = generate(nodes=2000, models=1000, now=now)
    for replica in decide(state, now).new:
        state.replicas[replica.id] = replica
    assert len(state.replicas) > 1000
    cp = ControlPlane.__new__(ControlPlane)  # the fold reads only the state
    cp.state = state
    fleet_families(cp, now)  # the first fold fills the views' memos
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        families = fleet_families(cp, now)
        timings.append(time.perf_counter() - started)
    assert sum(1 for f in families if f.name == "llmgw_model_short") == 1
    best = min(timings)
    print(
        f"fleet gauges at 2,000 nodes: best {best * 1000:.1f} ms, "
        f"worst {max(timings) * 1000:.1f} ms"
    )
    # About 20-40 ms on two shared cores; a scrape every 15 s can afford it.
    assert best < 0.25


PATRONI_CLUSTER = {
    "members": [
        {"name": "pg-1", "role": "leader", "state": "running", "host": "10.0.0.1", "port": 5432},
        {
            "name": "pg-2",
            "role": "replica",
            "state": "streaming",
            "host": "10.0.0.2",
            "port": 5432,
            "lag": 1048576,
        },
        {
            "name": "pg-3",
            "role": "replica",
            "state": "starting",
            "host": "10.0.0.3",
            "port": 5432,
            "lag": "unknown",
        },
    ]
}


async def test_store_members_come_from_patroni_without_stalling_a_scrape(plane: Plane) -> None:
    async def cluster(_: Request) -> JSONResponse:
        return JSONResponse(PATRONI_CLUSTER)

    async with serve_asgi(Starlette(routes=[Route("/cluster", cluster)])) as patroni:
        reader = PatroniReader([patroni])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ControlCollector(plane.cp, reader))
        # The first scrape starts the read and shows no members yet ...
        first = parse_scrape(generate_latest(registry).decode())
        assert first.samples("llmgw_store_members") == []
        await eventually(lambda: reader.cached() is not None, 5, "Patroni's members read")
        metrics = parse_scrape(generate_latest(registry).decode())
    assert metrics.by("llmgw_store_members", "member", "role", "state") == {
        ("pg-1", "leader", "running"): 1,
        ("pg-2", "replica", "streaming"): 1,
        ("pg-3", "replica", "starting"): 1,
    }
    # Lag in bytes where Patroni knows it, the leader's 0; absent, not 0, where unknown.
    assert metrics.by("llmgw_store_member_lag_bytes", "member") == {"pg-1": 0, "pg-2": 1048576}
    assert metrics.value("llmgw_store_members_unreadable") == 0
    promtool_check(metrics.text)


async def test_an_unreadable_patroni_is_a_metric(plane: Plane) -> None:
    reader = PatroniReader([f"http://127.0.0.1:{free_port()}"], timeout_s=0.5)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlCollector(plane.cp, reader))
    generate_latest(registry)
    await eventually(lambda: reader.cached() is not None, 5, "Patroni's answer (none)")
    metrics = parse_scrape(generate_latest(registry).decode())
    assert metrics.value("llmgw_store_members_unreadable") == 1
    assert metrics.samples("llmgw_store_members") == []
