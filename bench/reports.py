"""Agent report ingestion: how many reports a second `llmgw serve` takes in, at fleet size.

10,000 nodes reporting every 5 s is 2,000 reports a second. The fleet (from
``llmgw.sim.fleetgen``: four classes, 10 % MIG, one fabric per
node, a few models' weights on each node) is placed by one reconcile pass
and written to a real store (SQLite in a temporary data dir, or a fresh
PostgreSQL database with ``--pg``) with every replica ready and a node
token per node; then the real control plane (``llmgw serve``, its own
process) is started on it, and a client in a process of its own plays the
agents: every node reports, in turn, what an agent in the steady state
reports (its devices, weights and fabrics unchanged, each replica ready)
over HTTP/1.1 keep-alive connections, as fast as the control plane answers.
As a real agent's, each report carries fresh telemetry: every GPU's
utilisation, temperature, memory in use and power move between two reports
of a node (llmgw.sim.telemetry; ``--variants`` readings per node, sent in
turn), so no report repeats its node's previous one byte for byte (agents
report no per-replica load: that comes from the gateways). Each answer is
checked (200, the node's assignments). Two rounds over every node warm up
(each node's first report is its first to this instance, read whole; the
second leaves no node silent for long, since a node silent for 30 s turns
unreachable and its next report changes routing); the measured round runs
for ``--seconds``. With ``--variants 1`` every report of a node is the same
bytes, as this bench sent before telemetry moved.

    .venv/bin/python bench/reports.py --nodes 10000 [--telemetry moving]
    .venv/bin/python bench/reports.py --nodes 10000 --pg postgresql://postgres@127.0.0.1:5432/test

Printed: reports per second, latency percentiles, the control plane's CPU
time per report and its memory (RSS now and at its peak); the share of
reports byte-identical to their node's previous one and of those whose GPU
process lists changed (``--process-churn``: per device and report, the
chance a process starts or ends, as engines and probes come and go; 0.5 %
by default, a change every ~17 minutes per GPU at one report per 5 s;
``--telemetry still`` sends every node's one report, unchanged, as this
bench did before telemetry moved), and how the control
plane read the measured ones (its ``llmgw_control_agent_report_reads_total``
by path: same_bytes reused the node's last report, telemetry took only the
devices' readings, validated read the whole report). Last line: JSON with
nodes, reports_per_s, report_p99_ms, rss_mb, reused_share,
processes_changed_share, targets_met (>= 2,000 reports/s and p99 <= 250 ms on
each store measured) (and pg_* for --pg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
from llmgw.sim.telemetry import TelemetryWalk
from llmgw.wire import AgentReport, NodeState, ReplicaState, ReplicaStatus

TARGET_REPORTS_PER_S = 2000.0
TARGET_P99_MS = 250.0
CONNECTIONS = 48

_CLIENT = r"""
import asyncio, json, sys, time
try:
    import uvloop
except ImportError:
    uvloop = None

port, path = int(sys.argv[1]), sys.argv[2]
seconds, connections = float(sys.argv[3]), int(sys.argv[4])
nodes, first_variant, rounds = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
with open(path, "rb") as f:
    requests = f.read().split(b"\0\0REPORT\0\0")
variants = len(requests) // nodes

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
    # Round r sends every node's report variant (first_variant + r) % variants:
    # each node's next report carries its next telemetry reading.
    queue = iter(range(nodes * rounds))
    latencies = []
    async def worker():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in queue:
            if deadline is not None and time.perf_counter() > deadline:
                break
            variant = (first_variant + i // nodes) % variants
            start = time.perf_counter()
            await exchange(reader, writer, requests[variant * nodes + i % nodes])
            latencies.append(time.perf_counter() - start)
        writer.close()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return latencies, time.perf_counter() - started

async def main():
    deadline = time.perf_counter() + seconds if seconds > 0 else None
    latencies, elapsed = await run(rounds, deadline)
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


def report_requests(
    state: FleetState,
    tokens: dict[str, str],
    port: int,
    variants: int,
    seed: int,
    process_churn: float = 0.0,
) -> bytes:
    """Every node's report as a whole HTTP request, the way its agent sends it.

    ``variants`` reports per node (variant-major: all nodes' first, then all
    nodes' second, ...), each with the next telemetry reading of every device
    (sim.telemetry): what an agent reports changes with every report, as a
    real one's does. The rest (devices, weights, fabrics, replicas) is the
    steady state's.
    """
    out: list[list[bytes]] = [[] for _ in range(variants)]
    for name, node in state.nodes.items():
        assert node.inventory is not None
        statuses = [
            ReplicaStatus(
                replica_id=r.id,
                generation=r.generation,
                state=ReplicaState.READY,
                port=r.port,
                ready_at=r.ready_at,
            )
            for r in state.replicas.on_node(name)
            if r.leader_node == name
        ]
        report = AgentReport(
            node=name,
            agent_version="bench",
            address=node.address,
            fabrics=node.fabrics,
            inventory=node.inventory,
            replicas=statuses,
            weights=node.weights,
            agent_port=node.agent_port,
        )
        document = report.model_dump(mode="json")
        walk = TelemetryWalk(node.inventory, f"{seed}/{name}", process_churn)
        head_start = (
            f"POST /agent/v1/report HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {tokens[name]}\r\n"
            "Content-Type: application/json\r\n"
        )
        for variant in range(variants):
            for device, reading in zip(document["inventory"]["devices"], walk.step(), strict=True):
                device.update(reading)
            body = orjson.dumps(document)
            head = f"{head_start}Content-Length: {len(body)}\r\n\r\n"
            out[variant].append(head.encode() + body)
    return b"\0\0REPORT\0\0".join(request for batch in out for request in batch)


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


READS_METRIC = "llmgw_control_agent_report_reads_total"


def report_reads(port: int) -> dict[str, float] | None:
    """How the control plane has read its reports so far, by path (None: it does not say)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=120).text
    found = re.findall(rf'^{READS_METRIC}{{path="([a-z_]+)"}} ([0-9.e+]+)$', text, re.M)
    return {path: float(value) for path, value in found} if found else None


def identical_share(requests: bytes, nodes: int) -> float:
    """The share of the measured reports byte-identical to their node's previous one."""
    bodies = requests.split(b"\0\0REPORT\0\0")
    variants = len(bodies) // nodes
    same = sum(
        bodies[v * nodes + n] == bodies[(v - 1) % variants * nodes + n]
        for v in range(variants)
        for n in range(nodes)
    )
    return same / len(bodies)


def processes_changed_share(requests: bytes, nodes: int) -> float:
    """The share of the reports whose GPU process lists differ from their node's previous one."""
    bodies = requests.split(b"\0\0REPORT\0\0")
    variants = len(bodies) // nodes

    def lists(index: int) -> list[Any]:
        document = orjson.loads(bodies[index].split(b"\r\n\r\n", 1)[1])
        return [d.get("processes", []) for d in document["inventory"]["devices"]]

    changed = sum(
        lists(v * nodes + n) != lists((v - 1) % variants * nodes + n)
        for v in range(variants)
        for n in range(nodes)
    )
    return changed / len(bodies)


def run_client(
    port: int,
    requests: Path,
    args: argparse.Namespace,
    *,
    first_variant: int,
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    client = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLIENT,
            str(port),
            str(requests),
            str(seconds),
            str(args.connections),
            str(args.nodes),
            str(first_variant),
            str(rounds),
        ],
        capture_output=True,
        check=False,
    )
    if client.returncode != 0:
        raise SystemExit(f"the client failed: {client.stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(client.stdout)
    return result


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
        payload = report_requests(
            state, tokens, port, args.variants, args.seed, args.process_churn
        )
        requests.write_bytes(payload)
        identical = identical_share(payload, args.nodes)
        processes_changed = processes_changed_share(payload, args.nodes)
        del payload
        command = [
            sys.executable,
            "-m",
            "llmgw.cli.main",
            "serve",
            "--data-dir",
            str(data_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--trust-reported-fabrics",
            "--open-metrics",  # the run reads how reports were read
            "--log-level",
            "warning",
        ]
        if url:
            command += ["--database-url", url]
        serve = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            wait_ready(port, serve)
            # Every node once (variant 0): its first report to this instance,
            # read whole. Then once more: a node silent for 30 s turns
            # unreachable and its next report changes routing, and a first
            # round at 10,000 nodes can take that long; the measured round
            # starts with every node heard from moments ago.
            started = time.monotonic()
            first = run_client(port, requests, args, first_variant=0, rounds=1, seconds=0)
            second = run_client(port, requests, args, first_variant=1, rounds=1, seconds=0)
            warm_done = time.monotonic()
            reads_before = report_reads(port)
            before = proc_status(serve.pid)
            result = run_client(
                port, requests, args, first_variant=2, rounds=10**6, seconds=args.seconds
            )
            print(
                f"  warm-up: first round {first['elapsed']:.1f} s, second"
                f" {second['elapsed']:.1f} s, {warm_done - started:.1f} s in all; then"
                f" {time.monotonic() - warm_done - result['elapsed']:.1f} s before and after"
                " the measured round"
            )
            after = proc_status(serve.pid)
            reads_after = report_reads(port)
        finally:
            serve.terminate()
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                # Said, not hidden: a control plane that ignores SIGTERM is a bug
                # to chase; killed so the measured figures still print.
                print("  serve did not stop within 60 s of SIGTERM: killed", file=sys.stderr)
                serve.kill()
                serve.wait()
    latencies = sorted(result["latencies_ms"])
    count = result["count"]
    reads = (
        {path: reads_after[path] - (reads_before or {}).get(path, 0.0) for path in reads_after}
        if reads_after is not None
        else None
    )
    return {
        "reports": count,
        "reports_per_s": count / result["elapsed"],
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 99),
        "max_ms": latencies[-1],
        # The control plane's own CPU per report (its process, every thread),
        # over the measured round.
        "cpu_ms_per_report": (after["cpu_s"] - before["cpu_s"]) * 1000 / count,
        "rss_mb": after["VmRSS"],
        "peak_rss_mb": after["VmHWM"],
        "replicas": len(state.replicas),
        "identical_share": identical,
        "processes_changed_share": processes_changed,
        "reads": reads,
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
    print(
        f"{label}: {run['reports_per_s']:.0f} reports/s ({run['reports']} in the measured"
        f" round), latency p50 {run['p50_ms']:.1f} ms p99 {run['p99_ms']:.1f} ms max"
        f" {run['max_ms']:.1f} ms; control plane CPU {run['cpu_ms_per_report']:.2f} ms per"
        f" report, RSS {run['rss_mb']:.0f} MB (peak {run['peak_rss_mb']:.0f} MB)"
    )
    print(
        f"  reports byte-identical to their node's previous one: "
        f"{100 * run['identical_share']:.1f} %; whose GPU processes changed:"
        f" {100 * run['processes_changed_share']:.1f} %"
    )
    reads = run["reads"]
    if reads is None:
        print(f"  how the control plane read them: not exposed by this llmgw ({READS_METRIC})")
    else:
        total = sum(reads.values()) or 1.0
        print(
            "  how the control plane read them (measured round): "
            + ", ".join(f"{path} {100 * n / total:.1f} %" for path, n in sorted(reads.items()))
        )


def reuse_share(run: dict[str, Any]) -> float | None:
    """The share of the measured reports that the report route reused unvalidated."""
    reads = run["reads"]
    if reads is None:
        return None
    return round(reads.get("same_bytes", 0.0) / (sum(reads.values()) or 1.0), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--models", type=int, default=None, help="default: nodes / 2")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--telemetry",
        choices=("moving", "still"),
        default="moving",
        help="moving: each report carries the node's next NVML-like readings, and GPU"
        " processes come and go (--process-churn); still: every report of a node is the"
        " same bytes (--variants 1, no churn)",
    )
    parser.add_argument(
        "--variants",
        type=int,
        default=4,
        help="telemetry readings per node, sent in turn (1: every report of a node"
        " is the same bytes, as this bench sent before)",
    )
    parser.add_argument(
        "--process-churn",
        type=float,
        default=0.005,
        help="per device and report, the chance that a GPU process starts or ends",
    )
    parser.add_argument("--pg", default=None, help="also on PostgreSQL (a fresh database)")
    parser.add_argument(
        "--quick", action="store_true", help="1,000 nodes for 5 s (make bench-quick)"
    )
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.seconds = 1000, 5.0
    args.models = args.models or max(1, args.nodes // 2)
    if args.telemetry == "still":
        args.variants, args.process_churn = 1, 0.0
    if args.variants < 1:
        parser.error("--variants must be at least 1")
    load = os.getloadavg()[0]
    sqlite = measure(None, args)
    print(
        f"fleet: {args.nodes} nodes, {args.models} models, {sqlite['replicas']} replicas;"
        f" {args.connections} connections; load average {load:.1f}"
    )
    show("SQLite", sqlite)
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "reports_per_s": round(sqlite["reports_per_s"]),
        "report_p99_ms": round(sqlite["p99_ms"], 2),
        "rss_mb": round(sqlite["rss_mb"], 1),
        "peak_rss_mb": round(sqlite["peak_rss_mb"], 1),
        "report_p50_ms": round(sqlite["p50_ms"], 2),
        "cpu_ms_per_report": round(sqlite["cpu_ms_per_report"], 3),
        "identical_share": round(sqlite["identical_share"], 4),
        "processes_changed_share": round(sqlite["processes_changed_share"], 4),
        "telemetry": args.telemetry,
        "reused_share": reuse_share(sqlite),
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
            pg_reused_share=reuse_share(pg),
        )
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    report["targets_met"] = {
        "reports_per_s": report["reports_per_s"] >= TARGET_REPORTS_PER_S
        and report.get("pg_reports_per_s", TARGET_REPORTS_PER_S) >= TARGET_REPORTS_PER_S,
        "report_p99_ms": report["report_p99_ms"] <= TARGET_P99_MS
        and report.get("pg_report_p99_ms", TARGET_P99_MS) <= TARGET_P99_MS,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
