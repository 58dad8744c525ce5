"""Agent report ingestion: how many reports a second `llmgw serve` takes in, at fleet size.

10,000 nodes reporting every 5 s is 2,000 reports a second. The fleet (from
``llmgw.sim.fleetgen``: four classes, 10 % MIG, one fabric per
node, a few models' weights on each node) is placed by one reconcile pass
and written to a real store (SQLite in a temporary data dir, or a fresh
PostgreSQL database with ``--pg``) with every replica ready and a node
token per node; then the real control plane (``llmgw serve``, its own
process) is started on it, and a client in a process of its own plays the
agents: every node reports, in turn, what an agent in the steady state
reports (its unchanged inventory, weights and fabrics, each replica ready)
over HTTP/1.1 keep-alive connections, as fast as the control plane answers.
Each answer is checked (200, the node's assignments). A first round over
every node warms up (each node's first report is its first to this
instance); the measured round runs for ``--seconds``.

    .venv/bin/python bench/reports.py --nodes 10000
    .venv/bin/python bench/reports.py --nodes 10000 --pg postgresql://postgres@127.0.0.1:5432/test

Printed: reports per second, latency percentiles, the control plane's CPU
time per report and its memory (RSS now and at its peak). Last line: JSON
with nodes, reports_per_s, report_p99_ms, rss_mb (and pg_* for --pg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from llmgw import secrets
from llmgw.config import sqlite_url
from llmgw.control.rows import model_row, node_row, replica_row
from llmgw.control.scheduler.decide import decide
from llmgw.control.state import FleetState
from llmgw.control.store.repo import Store
from llmgw.sim import fleetgen
from llmgw.sim.benchstats import percentile
from llmgw.wire import AgentReport, NodeState, ReplicaState, ReplicaStatus

TARGET_REPORTS_PER_S = 2000.0
CONNECTIONS = 48

_CLIENT = r"""
import asyncio, json, sys, time
try:
    import uvloop
except ImportError:
    uvloop = None

port, path = int(sys.argv[1]), sys.argv[2]
seconds, connections = float(sys.argv[3]), int(sys.argv[4])
with open(path, "rb") as f:
    requests = f.read().split(b"\0\0REPORT\0\0")

async def exchange(reader, writer, request):
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    body = await reader.readexactly(length)
    if status != 200 or b'"assignments"' not in body:
        raise SystemExit("report answered %d: %r" % (status, body[:300]))

async def run(rounds, deadline):
    queue = iter(range(len(requests) * rounds))
    latencies = []
    async def worker():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in queue:
            if deadline is not None and time.perf_counter() > deadline:
                break
            start = time.perf_counter()
            await exchange(reader, writer, requests[i % len(requests)])
            latencies.append(time.perf_counter() - start)
        writer.close()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return latencies, time.perf_counter() - started

async def main():
    await run(1, None)  # every node once: its first report to this instance
    latencies, elapsed = await run(10**6, time.perf_counter() + seconds)
    print(json.dumps({"count": len(latencies), "elapsed": elapsed,
                      "latencies_ms": [round(x * 1000, 3) for x in latencies]}))

(uvloop.run if uvloop else asyncio.run)(main())
"""


def build_fleet(nodes: int, models: int, seed: int, now: float) -> FleetState:
    state = fleetgen.generate(nodes=nodes, models=models, seed=seed, now=now)
    for index, node in enumerate(state.nodes.values()):
        node.address = f"10.{index // 62500}.{index // 250 % 250}.{index % 250 + 1}"
        node.agent_port = 9000
        node.last_seen = now
        # A steady fleet: no node being drained (its replicas would move, and
        # the moved ones would never be reported ready by this client).
        if node.admin_state is NodeState.DRAINING:
            node.admin_state = NodeState.READY
    decisions = decide(state, now)
    for replica in decisions.new:
        replica.state = ReplicaState.READY
        replica.ready_at = now
        replica.port = 20000 + len(state.replicas) % 20000
        state.replicas[replica.id] = replica
    if decide(state, now + 1).changes_replicas:
        raise SystemExit("the bench fleet is not steady: a second pass would change it")
    return state


async def write_store(url: str, state: FleetState) -> dict[str, str]:
    """The fleet into a real store; the node tokens by node name."""
    tokens = {name: secrets.new_secret("llmgw-node-") for name in state.nodes}
    for name, node in state.nodes.items():
        node.token_hash = secrets.hash_secret(tokens[name])
    store = await Store.open(url)
    try:
        await store.upsert_nodes([node_row(n) for n in state.nodes.values()])
        await store.upsert_models([model_row(m) for m in state.models.values()])
        await store.write_replicas([replica_row(r) for r in state.replicas.values()])
    finally:
        await store.close()
    return tokens


def report_requests(state: FleetState, tokens: dict[str, str], port: int) -> bytes:
    """Every node's report as a whole HTTP request, the way its agent sends it."""
    out = []
    for name, node in state.nodes.items():
        assert node.inventory is not None
        statuses = [
            ReplicaStatus(replica_id=r.id, generation=r.generation, state=ReplicaState.READY,
                          port=r.port, ready_at=r.ready_at)
            for r in state.replicas.on_node(name) if r.leader_node == name
        ]
        report = AgentReport(node=name, agent_version="bench", address=node.address,
                             fabrics=node.fabrics, inventory=node.inventory, replicas=statuses,
                             weights=node.weights, agent_port=node.agent_port)
        body = orjson.dumps(report.model_dump(mode="json"))
        head = (f"POST /agent/v1/report HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {tokens[name]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        out.append(head.encode() + body)
    return b"\0\0REPORT\0\0".join(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_status(pid: int) -> dict[str, float]:
    """RSS now and at its peak (MB), CPU seconds so far, of one process."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llmgw serve exited ({proc.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz/leader", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("llmgw serve did not lead within the timeout")


def measure(url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    now = time.time()
    state = build_fleet(args.nodes, args.models, args.seed, now)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "cp"
        data_dir.mkdir()
        store_url = url or sqlite_url(data_dir)
        tokens = asyncio.run(write_store(store_url, state))
        port = free_port()
        requests = Path(tmp) / "requests.bin"
        requests.write_bytes(report_requests(state, tokens, port))
        command = [sys.executable, "-m", "llmgw.cli.main", "serve", "--data-dir", str(data_dir),
                   "--host", "127.0.0.1", "--port", str(port), "--trust-reported-fabrics",
                   "--log-level", "warning"]
        if url:
            command += ["--database-url", url]
        serve = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            wait_ready(port, serve)
            before = proc_status(serve.pid)
            client = subprocess.run(
                [sys.executable, "-c", _CLIENT, str(port), str(requests), str(args.seconds),
                 str(args.connections)],
                capture_output=True, check=False,
            )
            after = proc_status(serve.pid)
        finally:
            serve.terminate()
            serve.wait(timeout=60)
        if client.returncode != 0:
            raise SystemExit(f"the client failed: {client.stderr.decode()[-2000:]}")
    result = json.loads(client.stdout)
    latencies = sorted(result["latencies_ms"])
    count = result["count"]
    return {
        "reports": count,
        "reports_per_s": count / result["elapsed"],
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 99),
        "max_ms": latencies[-1],
        # The control plane's own CPU per report (its process, every thread),
        # over the whole client run (the warm-up round included).
        "cpu_ms_per_report": (after["cpu_s"] - before["cpu_s"]) * 1000
        / (count + args.nodes),
        "rss_mb": after["VmRSS"],
        "peak_rss_mb": after["VmHWM"],
        "replicas": len(state.replicas),
    }


def fresh_pg_database(url: str) -> tuple[str, str]:
    """A new, empty database next to the one given (the bench writes a whole fleet)."""
    import psycopg

    name = f"llmgw_bench_reports_{os.getpid()}"
    admin = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}", name


def drop_pg_database(url: str, name: str) -> None:
    import psycopg

    admin = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def show(label: str, run: dict[str, Any]) -> None:
    print(f"{label}: {run['reports_per_s']:.0f} reports/s ({run['reports']} in the measured"
          f" round), latency p50 {run['p50_ms']:.1f} ms p99 {run['p99_ms']:.1f} ms max"
          f" {run['max_ms']:.1f} ms; control plane CPU {run['cpu_ms_per_report']:.2f} ms per"
          f" report, RSS {run['rss_mb']:.0f} MB (peak {run['peak_rss_mb']:.0f} MB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--models", type=int, default=None, help="default: nodes / 2")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pg", default=None, help="also on PostgreSQL (a fresh database)")
    args = parser.parse_args()
    args.models = args.models or max(1, args.nodes // 2)
    load = os.getloadavg()[0]
    sqlite = measure(None, args)
    print(f"fleet: {args.nodes} nodes, {args.models} models, {sqlite['replicas']} replicas;"
          f" {args.connections} connections; load average {load:.1f}")
    show("SQLite", sqlite)
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "reports_per_s": round(sqlite["reports_per_s"]),
        "report_p99_ms": round(sqlite["p99_ms"], 2),
        "rss_mb": round(sqlite["rss_mb"], 1),
        "peak_rss_mb": round(sqlite["peak_rss_mb"], 1),
        "report_p50_ms": round(sqlite["p50_ms"], 2),
        "cpu_ms_per_report": round(sqlite["cpu_ms_per_report"], 3),
    }
    if args.pg:
        url, name = fresh_pg_database(args.pg)
        try:
            pg = measure(url, args)
        finally:
            drop_pg_database(args.pg, name)
        show("PostgreSQL", pg)
        report.update(
            pg_reports_per_s=round(pg["reports_per_s"]),
            pg_report_p99_ms=round(pg["p99_ms"], 2),
            pg_rss_mb=round(pg["rss_mb"], 1),
            pg_peak_rss_mb=round(pg["peak_rss_mb"], 1),
            pg_cpu_ms_per_report=round(pg["cpu_ms_per_report"], 3),
        )
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    report["targets_met"] = {
        "reports_per_s": report["reports_per_s"] >= TARGET_REPORTS_PER_S
        and report.get("pg_reports_per_s", TARGET_REPORTS_PER_S) >= TARGET_REPORTS_PER_S,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
