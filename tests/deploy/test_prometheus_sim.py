"""The alert rules and the dashboard against a real Prometheus scraping ``llmgw up --sim``.

A simulated fleet (MIG instances, unhealthy cards, a model that fails every
start and is parked, one that cannot be placed), one more node whose real
agent serves /metrics over fake GPUs (tests/deploy/gpu_node.py), a fake
Patroni in front of the store's figures, and Debian's Prometheus scraping
them every second with deploy/prometheus/llmgw-alerts.yml loaded. Each
alert's expression, asked of Prometheus's API, must return exactly what the
fleet's own admin API shows, before and after the node is lost (its process
killed) and the store loses its leader; the alerts Prometheus evaluates
itself must be pending or firing accordingly. Last, every panel of the
Grafana dashboard is drawn from the same Prometheus (deploy/grafana/render.py):
no query may be refused, and the screenshot lands in LLMGW_TEST_OUTPUT.

``llmgw up`` runs with its clocks shortened (tests/deploy/quick_up.py), so a
node is unreachable after 4 s and a model parks after 2 failed starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.servers import free_port, llmgw_up, serve_asgi, stop_process
from tests.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "llmgw-alerts.yml"
RENDER = ROOT / "deploy" / "grafana" / "render.py"
PROMETHEUS = "/usr/bin/prometheus"
TOKEN = "llmgw-metrics-alerts"
MIB = 1024 * 1024
WAIT_S = 45.0  # for anything the fleet, its agents or Prometheus do

FLEET = """\
fabrics: [ib-a]
nodes:
  - {count: 2, name: a100, class: a100-80g, gpus: 2, fabric: ib-a, unhealthy: 1,
     mig: {cards: 1, profile: 3g.40gb, instances: 2}}
  - {count: 1, name: l4, class: l4-24g, gpus: 1, fabric: ib-a}
models:
  - {name: sim-chat, engine: sim, gpu_classes: [a100-80g-mig-3g.40gb],
     min_replicas: 2, max_replicas: 2, sim: {startup_s: 0.2}}
  # Only the gpu-node has h100-80g cards: lost with it.
  - {name: sim-embed, engine: sim, gpu_classes: [h100-80g], min_replicas: 1,
     sim: {startup_s: 0.2}}
  - {name: sim-broken, engine: sim, gpu_classes: [l4-24g], min_replicas: 1,
     sim: {fault: fail_at_start, startup_s: 0.1}}
  - {name: sim-huge, engine: sim, gpu_classes: [a100-80g], gpus: 4, tp: 4, min_replicas: 1}
"""

HEALTHY_STORE = [
    {"name": "pg-a", "role": "leader", "state": "running", "host": "10.0.0.1", "port": 5432},
    {"name": "pg-b", "role": "sync_standby", "state": "streaming", "host": "10.0.0.2",
     "port": 5432, "lag": 0},
]
LEADERLESS_STORE = [
    {"name": "pg-a", "role": "replica", "state": "stopped", "host": "10.0.0.1", "port": 5432,
     "lag": "unknown"},
    {"name": "pg-b", "role": "replica", "state": "streaming", "host": "10.0.0.2", "port": 5432,
     "lag": 5 * MIB},
]


@dataclass
class Setup:
    api: httpx.AsyncClient  # the control plane: admin API and /v1
    api_key: str
    prom: httpx.AsyncClient
    prom_url: str
    node: asyncio.subprocess.Process
    agent_target: str
    cluster: dict[str, Any]
    root: Path

    async def get(self, path: str) -> Any:
        answer = await self.api.get(f"/admin/v1{path}")
        answer.raise_for_status()
        return answer.json()

    async def query(self, expr: str) -> list[dict[str, Any]]:
        answer = await self.prom.get("/api/v1/query", params={"query": expr})
        assert answer.status_code == 200, answer.text
        return list(answer.json()["data"]["result"])


def prometheus_config(up_port: int, agent_target: str) -> str:
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "llmgw-control", "scrape_interval": "1s",
             "authorization": {"credentials": TOKEN},
             "static_configs": [{"targets": [f"127.0.0.1:{up_port}"]}]},
            {"job_name": "llmgw-agent", "scrape_interval": "1s",
             "static_configs": [{"targets": [agent_target]}]},
        ],
    })


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setup]:
    assert os.access(PROMETHEUS, os.X_OK), "prometheus is missing: apt-get install prometheus"
    root = tmp_path_factory.mktemp("alerts")
    (root / "fleet.yaml").write_text(FLEET)
    cluster: dict[str, Any] = {"scope": "llmgw", "members": HEALTHY_STORE}

    async def patroni_cluster(_: Request) -> JSONResponse:
        return JSONResponse(cluster)

    procs: list[asyncio.subprocess.Process] = []
    logs = []

    async def spawn(name: str, *argv: str, **env: str) -> asyncio.subprocess.Process:
        log = (root / f"{name}.log").open("w")
        logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, stdout=log, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        procs.append(proc)
        return proc

    patroni_app = Starlette(routes=[Route("/cluster", patroni_cluster)])
    async with serve_asgi(patroni_app) as patroni, llmgw_up(
        root, "--sim", str(root / "fleet.yaml"), within_s=WAIT_S,
        command=(sys.executable, "-m", "tests.deploy.quick_up"),
        env={"LLMGW_METRICS_TOKEN": TOKEN, "LLMGW_PATRONI_URL": patroni},
    ) as up:
        try:
            agent_port = free_port()
            node = await spawn("gpu-node", sys.executable, "-m", "tests.deploy.gpu_node",
                               str(up.data / "up.json"), str(root / "gpu-node"), str(agent_port))
            async with httpx.AsyncClient(
                base_url=up.info["admin_url"], timeout=15,
                headers={"Authorization": f"Bearer {up.info['admin_token']}"},
            ) as api:
                async def registered() -> Any:
                    assert node.returncode is None, (root / "gpu-node.log").read_text()[-3000:]
                    nodes = (await api.get("/admin/v1/nodes")).json()
                    # Its server's port comes with its first report.
                    return next((n for n in nodes
                                 if n["name"] == "gpu-node" and n["agent_port"]), None)

                # The scrape target as an operator finds it: the node's agent_port.
                found = await eventually(registered, WAIT_S, what="gpu-node registered")
                agent_target = f"{found['address']}:{found['agent_port']}"
                assert found["agent_port"] == agent_port
                (root / "prometheus.yml").write_text(prometheus_config(up.port, agent_target))
                prom_port = free_port()
                await spawn("prometheus", PROMETHEUS,
                            f"--config.file={root / 'prometheus.yml'}",
                            f"--storage.tsdb.path={root / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn")
                prom_url = f"http://127.0.0.1:{prom_port}"
                async with httpx.AsyncClient(base_url=prom_url, timeout=15) as prom:
                    async def ready() -> bool:
                        try:
                            return (await prom.get("/-/ready")).status_code == 200
                        except httpx.TransportError:
                            return False

                    await eventually(ready, WAIT_S, what="prometheus ready",
                                     note=lambda: (root / "prometheus.log").read_text()[-2000:])
                    yield Setup(api, up.info["api_key"], prom, prom_url, node, agent_target,
                                cluster, root)
        finally:
            # Prometheus killed, the node's agent stopped; `llmgw up` after them.
            for proc in reversed(procs):
                await stop_process(proc, signal.SIGKILL if proc is procs[-1] else signal.SIGINT)
            for log in logs:
                log.close()


# -- what each alert's expression must return, from the admin API ----------------------


def rules() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


async def expected(s: Setup, lost: bool) -> dict[str, dict[Any, float]]:
    """Each alert's expected result (labels -> value), read from the fleet's admin API."""
    summary, models, nodes = await s.get("/summary"), await s.get("/models"), await s.get("/nodes")
    store = {m["name"]: m for m in summary["store"]}
    gpu_node = next(n for n in nodes if n["name"] == "gpu-node")
    leaders = [m for m in summary["store"] if m["role"] in ("leader", "master", "primary")
               and m["state"] == "running"]
    return {
        "LlmgwNodeUnreachable": ({(): summary["nodes"]["unreachable"]}
                                 if summary["nodes"]["unreachable"] else {}),
        "LlmgwModelShort": {m["name"]: 1 for m in models
                            if m["parked"] or m["ready"] < m["desired"]},
        "LlmgwModelUnplaceable": {name: 1 for name in summary["unplaceable"]},
        "LlmgwModelParked": {p["model"]: 1 for p in summary["parked"]},
        "LlmgwGpuUnhealthy": {g["class"]: g["unhealthy"] for g in summary["gpus"]
                              if g["unhealthy"]},
        # Per device, from the agent: gone with its scrape target.
        "LlmgwDeviceUnhealthy": {} if lost else {
            (s.agent_target, d["label"]): 0 for d in gpu_node["devices"] if not d["healthy"]},
        "LlmgwTargetDown": {("llmgw-agent", s.agent_target): 0} if lost else {},
        "LlmgwNoControlPlaneLeader": {},
        "LlmgwReconcileStalled": {},
        "LlmgwStoreNoLeader": {} if leaders or not store else {(): len(store)},
        "LlmgwStoreMemberLagging": {name: m["lag"] for name, m in store.items()
                                    if m["lag"] > MIB},
        "LlmgwStoreUnreadable": {(): 1} if summary["store_error"] else {},
        # All of sim-broken's requests were 503 (parked); sim-chat's were 200.
        "LlmgwGatewayErrorRate": {"sim-broken": 1.0},
        # No key or team of this fleet has a budget or a token quota, so nothing is spent
        # toward one (the rules firing is promtool's test in test_rules_and_dashboard).
        "LlmgwBudgetNearlySpent": {},
        "LlmgwBudgetRunsOutSoon": {},
        "LlmgwTokenQuotaNearlyUsed": {},
    }


def key(alert: str, labels: dict[str, str]) -> Any:
    """The labels an alert's result is compared by (what `by (...)` keeps)."""
    if alert in ("LlmgwModelShort", "LlmgwModelUnplaceable", "LlmgwModelParked",
                 "LlmgwGatewayErrorRate"):
        return labels["model"]
    if alert == "LlmgwGpuUnhealthy":
        return labels["class"]
    if alert == "LlmgwStoreMemberLagging":
        return labels["member"]
    if alert == "LlmgwDeviceUnhealthy":
        return labels["instance"], labels["device"]
    if alert == "LlmgwTargetDown":
        return labels["job"], labels["instance"]
    if alert in ("LlmgwBudgetNearlySpent", "LlmgwBudgetRunsOutSoon", "LlmgwTokenQuotaNearlyUsed"):
        return labels["tenant"], labels["name"], labels.get("limit")
    assert not labels, f"{alert}: unexpected labels {labels}"
    return ()


async def compare_all(s: Setup, lost: bool) -> None:
    """Every expression's answer equals the fleet's, read before and after it (steady)."""
    exprs = rules()
    seen: dict[str, Any] = {}

    async def agree() -> bool:
        before = await expected(s, lost)
        got = {}
        for alert, expr in exprs.items():
            got[alert] = {key(alert, r["metric"]): round(float(r["value"][1]), 6)
                          for r in await s.query(expr)}
        after = await expected(s, lost)
        seen.update(got=got, fleet=after)
        return before == after and got == after

    await eventually(
        agree, WAIT_S, what=f"every alert's expression to match the fleet (lost={lost})",
        note=lambda: {a: (seen["got"][a], seen["fleet"][a]) for a in seen.get("got", {})
                      if seen["got"][a] != seen["fleet"][a]},
    )
    assert set(seen["got"]) == set(exprs)


async def active_alerts(s: Setup) -> dict[tuple[str, Any], str]:
    answer = (await s.prom.get("/api/v1/alerts")).json()["data"]["alerts"]
    return {(a["labels"]["alertname"], key(a["labels"]["alertname"], {
        k: v for k, v in a["labels"].items() if k not in ("alertname", "severity")})): a["state"]
            for a in answer}


# -- the test -----------------------------------------------------------------------------


async def test_alerts_match_the_fleet_and_the_dashboard_draws(setup: Setup) -> None:
    s = setup

    async def steady() -> bool:
        summary = await s.get("/summary")
        return (summary["replicas"]["ready"] == 3 and bool(summary["parked"])
                and bool(summary["store"]))

    await eventually(steady, WAIT_S, what="3 ready replicas, a parked model, the store's members",
                     note=lambda: s.root.joinpath("up.log").read_text()[-2000:])

    async def scraped() -> bool:
        return len(await s.query('up == 1')) == 2

    # A counter's first sample is its start to rate() and increase(): no
    # traffic before Prometheus has scraped both targets once.
    await eventually(scraped, WAIT_S, what="Prometheus scraping both targets")

    # Traffic over a few seconds of scrapes; sim-broken answers 503 (parked).
    headers = {"Authorization": f"Bearer {s.api_key}"}
    statuses: dict[str, list[int]] = {}
    for i in range(20):
        for model in ("sim-broken", "sim-chat", "sim-embed")[: 2 + i % 2]:
            answer = await s.api.post("/v1/chat/completions", headers=headers, json={
                "model": model, "max_tokens": 8, "stream": model == "sim-chat",
                "messages": [{"role": "user", "content": "one two three four " * 8}]})
            statuses.setdefault(model, []).append(answer.status_code)
        await asyncio.sleep(0.1)
    assert statuses == {"sim-broken": [503] * 20, "sim-chat": [200] * 20,
                        "sim-embed": [200] * 10}

    await compare_all(s, lost=False)

    async def evaluated() -> dict[tuple[str, Any], str] | None:
        alerts = await active_alerts(s)
        return alerts if ("LlmgwGatewayErrorRate", "sim-broken") in alerts else None

    alerts = await eventually(evaluated, WAIT_S, what="Prometheus's own evaluation of the rules")
    # `for: 0` fires at once; the others wait out their `for`.
    assert alerts == {
        ("LlmgwModelParked", "sim-broken"): "firing",
        ("LlmgwModelShort", "sim-broken"): "pending",
        ("LlmgwModelShort", "sim-huge"): "pending",
        ("LlmgwModelUnplaceable", "sim-huge"): "pending",
        ("LlmgwGpuUnhealthy", "a100-80g"): "pending",
        ("LlmgwGpuUnhealthy", "h100-80g"): "pending",
        ("LlmgwDeviceUnhealthy", (s.agent_target, "2")): "pending",
        ("LlmgwGatewayErrorRate", "sim-broken"): "pending",
    }

    # Lose the node (its process, engines and all) and the store's leader.
    s.node.kill()
    await s.node.wait()
    s.cluster["members"] = LEADERLESS_STORE

    async def lost() -> bool:
        summary = await s.get("/summary")
        return (summary["nodes"]["unreachable"] == 1
                and {m["name"]: m["lag"] for m in summary["store"]}.get("pg-b") == 5 * MIB)

    await eventually(lost, WAIT_S, what="the node unreachable and the store leaderless")
    await compare_all(s, lost=True)
    new = {("LlmgwNodeUnreachable", ()), ("LlmgwTargetDown", ("llmgw-agent", s.agent_target)),
           ("LlmgwStoreNoLeader", ()), ("LlmgwStoreMemberLagging", "pg-b"),
           ("LlmgwModelShort", "sim-embed")}

    async def evaluated_lost() -> dict[tuple[str, Any], str] | None:
        alerts = await active_alerts(s)
        return alerts if new <= set(alerts) else None

    alerts = await eventually(evaluated_lost, WAIT_S, what="the lost node's and store's alerts")
    assert {alerts[name] for name in new} == {"pending"}
    # The device's own alert went with its agent's series; the fleet's stays.
    assert not any(name == "LlmgwDeviceUnhealthy" for name, _ in alerts)
    assert ("LlmgwGpuUnhealthy", "h100-80g") in alerts

    # The dashboard, drawn from what Prometheus scraped.
    out = Path(os.environ.get("LLMGW_TEST_OUTPUT") or s.root)
    os.makedirs(out, exist_ok=True)
    summary_path = s.root / "panels.json"
    render = await asyncio.create_subprocess_exec(
        sys.executable, str(RENDER), "--prometheus", s.prom_url, "--minutes", "2",
        "--rate-interval", "10s", "--out", str(out / "grafana-dashboard.png"),
        "--summary", str(summary_path), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await render.communicate()
    assert render.returncode == 0, output.decode()
    panels = json.loads(summary_path.read_text())
    empty = sorted(title for title, p in panels.items() if not p["series"])
    # Sim models have no weights to cache, no store write failed, and the one
    # agent scraped is gone (its table is an instant query); every other
    # panel has data.
    assert empty == ["Store write errors", "Unhealthy devices", "Weights cache"], empty
    assert (out / "grafana-dashboard.png").stat().st_size > 50_000
