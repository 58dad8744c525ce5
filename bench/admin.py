"""Fleet summary latency at scale: GET /admin/v1/summary on 2,000 nodes x 8 GPUs.

The fleet is generated straight into FleetState (no agents): nodes in
several fabrics, a mix of whole cards and MIG instances, a few unhealthy
GPUs, cordoned, draining and unreachable nodes, weights on about half the
nodes, and replicas of 1, 2, 4 and 8 GPUs filling about 70 % of the cards,
most ready (some idle for hours), some starting with a download under way.

The summary is asked for through the real HTTP route: uvicorn on 127.0.0.1
(an ephemeral port) serving the control plane's app, asked one request at
a time by an httpx client in a process of its own (the reported figures), and
for comparison by one inside the server's process and event loop, whose own
work then adds to every figure. A baseline in the same run asks for the summary of an
empty fleet (everything but the fleet-sized work), and the views + summary
are also timed as a plain function call.

    python bench/admin.py [--quick] [--nodes 2000] [--gpus 8] [--calls 300]

Last line: one JSON object with nodes, summary_p50_ms, summary_p99_ms, and the
server's share of a call (server_cpu_ms_per_call, its collections while timed).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from llmgw import wire
from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.control.gcpause import freeze_survivors, paused_gc
from llmgw.control.plane import ControlPlane
from llmgw.control.state import FleetState, ModelRecord, NodeRecord, ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.serving import start_server
from llmgw.sim.benchstats import percentile

FABRICS = 8
MODELS = 60


def _devices(rng: random.Random, node: int, gpus: int, mig: bool) -> list[wire.Device]:
    out: list[wire.Device] = []
    for card in range(gpus):
        healthy = rng.random() > 0.005
        reasons = [] if healthy else ["uncorrectable ECC errors: 2"]
        if mig and card < 2:
            # Two cards in MIG mode, carved into two 3g.40gb instances each.
            for inst in range(2):
                number = wire.mig_number(card, inst)
                out.append(
                    wire.Device(
                        number=number,
                        label=f"{card}/mig{inst}",
                        uuid=f"MIG-{node}-{card}-{inst}",
                        name="NVIDIA A100-SXM4-80GB",
                        gpu_class="a100-80g-mig-3g.40gb",
                        memory_total_mib=40192,
                        temperature_c=40,
                        power_w=80.0,
                        healthy=healthy,
                        unhealthy_reasons=reasons,
                        mig=wire.MigInfo(
                            parent_uuid=f"GPU-{node}-{card}",
                            parent_index=card,
                            gpu_instance_id=inst + 1,
                            compute_instance_id=0,
                            profile="3g.40gb",
                        ),
                    )
                )
            continue
        cls, name = (
            ("a100-80g", "NVIDIA A100-SXM4-80GB") if mig else ("h100-80g", "NVIDIA H100 80GB HBM3")
        )
        out.append(
            wire.Device(
                number=card,
                label=str(card),
                uuid=f"GPU-{node}-{card}",
                name=name,
                gpu_class=cls,
                memory_total_mib=81559,
                memory_used_mib=rng.randint(0, 80000),
                utilization_pct=rng.randint(0, 100),
                temperature_c=rng.randint(30, 80),
                power_w=rng.uniform(60, 700),
                healthy=healthy,
                unhealthy_reasons=reasons,
            )
        )
    return out


def make_fleet(nodes: int, gpus: int, now: float, seed: int = 7) -> FleetState:
    rng = random.Random(seed)
    state = FleetState()
    specs = []
    for m in range(MODELS):
        size = (1, 1, 2, 4, 8)[m % 5]
        specs.append(
            wire.ModelSpec(
                name=f"model-{m:02d}",
                engine=wire.EngineKind.SIM,
                gpu_classes=["h100-80g", "a100-80g"],
                gpus=size,
                tp=size,
                min_replicas=0 if m % 7 == 0 else 1,
                max_replicas=400,
            )
        )
        state.models[specs[-1].name] = ModelRecord(
            spec=specs[-1],
            created_at=now - 86400,
            updated_at=now - 86400,
            parked=m % 29 == 3,
            failures=5 if m % 29 == 3 else 0,
            last_error="engine exited (1)" if m % 29 == 3 else None,
            demand_at=now - 30 if m % 7 == 0 else None,
            unplaceable_reason="needs 8 free h100-80g on one node; none has"
            if m % 17 == 5
            else None,
        )
    for n in range(nodes):
        mig = n % 10 == 9
        name = f"node-{n:05d}"
        record = NodeRecord(
            name=name,
            registered_at=now - 86400,
            address=f"10.{n // 250}.{n % 250}.1",
            agent_port=9000,
            fabrics=[f"ib-{n % FABRICS}"],
            inventory=wire.NodeInventory(
                hostname=name, source="fake", devices=_devices(rng, n, gpus, mig)
            ),
            weights=[wire.WeightsEntry(model=f"model-{(n + k) % MODELS:02d}") for k in range(3)]
            if n % 2 == 0
            else [],
            last_seen=now - 40 if n % 97 == 0 else now - 1,
            admin_state=wire.NodeState.CORDONED
            if n % 53 == 0
            else (wire.NodeState.DRAINING if n % 71 == 0 else wire.NodeState.READY),
        )
        state.nodes[name] = record
    _place_replicas(state, specs, rng, now)
    return state


def _place_replicas(
    state: FleetState, specs: list[wire.ModelSpec], rng: random.Random, now: float
) -> None:
    counter = 0
    for node in state.nodes.values():
        assert node.inventory is not None
        free = [d.number for d in node.inventory.devices if d.healthy and d.gpu_class != "cpu"]
        while free and rng.random() < 0.8:
            spec = rng.choice(specs)
            size = 1 if free[0] >= 1000 else spec.gpus
            if size > len(free):
                break
            taken, free = free[:size], free[size:]
            counter += 1
            rid = f"r{counter:06d}"
            ready = rng.random() < 0.9
            replica = ReplicaRecord(
                id=rid,
                model=spec.name,
                created_at=now - 7200,
                shards=[wire.ShardAssignment(node=node.name, device_numbers=taken)],
                state=wire.ReplicaState.READY if ready else wire.ReplicaState.STARTING,
                port=20000 + counter % 10000,
                ready_at=now - 3600 if ready else None,
                last_request_at=now - rng.choice((5, 60, 900, 7200)) if ready else None,
            )
            state.replicas[rid] = replica
            node.statuses[rid] = wire.ReplicaStatus(
                replica_id=rid,
                state=replica.state,
                port=replica.port,
                log_tail=["INFO loading weights", "INFO ready"],
                download=None
                if ready
                else wire.DownloadProgress(bytes_done=5 << 30, bytes_total=16 << 30),
            )


def _app(cp: ControlPlane) -> FastAPI:
    from llmgw.control.app import create_app

    return create_app(cp)


async def _serve(app: FastAPI) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto
    # says TCP, and without it every answer waited ~40 ms for a delayed ACK (measured).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http="httptools")
    )
    task = await start_server(server, [sock])
    return server, task, f"http://127.0.0.1:{port}"


_CLIENT = """
import json, sys, time, httpx
base, token, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = []
with httpx.Client(base_url=base, headers={"Authorization": "Bearer " + token},
                  timeout=30) as client:
    for warm in range(5):
        client.get("/admin/v1/summary").json()
    for _ in range(calls):
        start = time.perf_counter()
        response = client.get("/admin/v1/summary")
        response.json()
        out.append((time.perf_counter() - start) * 1000)
        if response.status_code != 200:
            sys.exit("summary answered %d" % response.status_code)
print(json.dumps(out))
"""


async def _timings_other_process(base: str, token: str, calls: int) -> list[float]:
    """The same requests from a client in its own process, as a real one is:
    its sending and parsing then run beside the server, not inside its loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CLIENT,
        base,
        token,
        str(calls),
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the client process failed ({proc.returncode})")
    timings: list[float] = json.loads(stdout)
    return timings


async def _timings(client: httpx.AsyncClient, url: str, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        response = await client.get(url)
        response.json()
        out.append((time.perf_counter() - start) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"summary answered {response.status_code}: {response.text[:200]}")
    return out


_FULL_COLLECTIONS = [0]


def _count_full_collections(phase: str, info: dict[str, Any]) -> None:
    if phase == "start" and info["generation"] == 2:
        _FULL_COLLECTIONS[0] += 1


class _Pauses:
    """The server process's cyclic collections while the out-of-process client
    is timed (a collection is a pause of every request in flight): count and
    longest, per generation."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            took = (time.perf_counter() - self._started) * 1000
            self.by_generation.setdefault(info["generation"], []).append(took)

    def summary(self) -> dict[str, Any]:
        return {
            f"gen{g}": {"count": len(v), "max_ms": round(max(v), 1)}
            for g, v in sorted(self.by_generation.items())
        }


def _p(values: list[float], q: float) -> float:
    return percentile(values, q * 100) or 0.0


# Agents report every 5 s; the fleet's reports arrive spread over that time.
REPORT_EVERY_S = 5.0
HEARTBEAT_STEPS = 50


async def _heartbeats(fleet: FleetState, reporting: list[str]) -> None:
    """The reporting nodes' last_seen moved as their reports would move it: each
    node every REPORT_EVERY_S, a slice of them every tenth of a second.

    Without this every node fell silent 30 s after the fleet was generated,
    part way through the timed calls: every replica then counted as
    unreachable, the idle list emptied and the answer shrank from ~480 kB to
    2 kB (and the call that saw it happen rebuilt the whole summary), so
    the figures were half of another fleet's.

    And once per round, what the runtime does after each heartbeat flush
    (runtime.py): the long-lived objects that grew (the route's kept
    summary) go out of the collector's reach once there are many.
    """
    step = 0
    while True:
        await asyncio.sleep(REPORT_EVERY_S / HEARTBEAT_STEPS)
        now = time.time()
        for name in reporting[step::HEARTBEAT_STEPS]:
            fleet.nodes[name].last_seen = now
        step = (step + 1) % HEARTBEAT_STEPS
        if step == 0:
            freeze_survivors()


async def run(nodes: int, gpus: int, calls: int) -> dict[str, Any]:
    now = time.time()
    t0 = time.perf_counter()
    fleet = make_fleet(nodes, gpus, now)
    gen_s = time.perf_counter() - t0
    # What a running control plane does with its long-lived state (runtime.py
    # freezes it after every heartbeat flush, `up`/`serve` after start): the
    # cyclic collector then skips the fleet's objects.
    gc.collect()
    gc.freeze()
    # The nodes generated silent stay so; the rest report from now on.
    reporting = [n.name for n in fleet.nodes.values() if (n.last_seen or 0.0) > now - 10]
    for name in reporting:
        fleet.nodes[name].last_seen = time.time()
    heartbeats = asyncio.create_task(_heartbeats(fleet, reporting))
    with tempfile.TemporaryDirectory() as tmp:
        store = await Store.open(f"sqlite:///{Path(tmp) / 'bench.db'}")
        empty_cp = ControlPlane(store)
        creds = await empty_cp.ensure_credentials(first_api_key=False)
        cp = ControlPlane(store, state=fleet)
        await cp.ensure_credentials(first_api_key=False)
        headers = {"Authorization": f"Bearer {creds.admin_token}"}
        # The route's own work without HTTP: views folded into the summary and
        # serialised, the collector paused as the route pauses it.
        direct = []
        for _ in range(max(5, calls // 10)):
            start = time.perf_counter()
            with paused_gc():
                fleet_summary(fleet, time.time(), StoreStatus([])).model_dump_json()
            direct.append((time.perf_counter() - start) * 1000)
        results: dict[str, list[float]] = {}
        server_cpu: dict[str, float] = {}
        server_gc: dict[str, dict[str, Any]] = {}
        for label, plane in (("empty", empty_cp), ("fleet", cp)):
            server, task, base = await _serve(_app(plane))
            try:
                async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
                    await _timings(client, "/admin/v1/summary", 5)  # warm-up
                    _FULL_COLLECTIONS[0] = 0
                    results[label + "_inprocess"] = await _timings(
                        client, "/admin/v1/summary", calls
                    )
                    assert creds.admin_token
                    # This process does nothing else meanwhile: its CPU time
                    # is the server's work for these calls.
                    pauses = _Pauses()
                    gc.callbacks.append(pauses)
                    cpu = time.process_time()
                    results[label] = await _timings_other_process(base, creds.admin_token, calls)
                    server_cpu[label] = (time.process_time() - cpu) * 1000 / calls
                    gc.callbacks.remove(pauses)
                    server_gc[label] = pauses.summary()
                    if label == "fleet":
                        answer = await client.get("/admin/v1/summary")
                        answer_bytes = len(answer.content)
                        body = answer.json()
            finally:
                server.should_exit = True
                await task
        await store.close()
    heartbeats.cancel()
    fleet_ms, empty_ms = results["fleet"], results["empty"]
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "devices": sum(c["total"] for c in body["gpus"]),
        "replicas": len(fleet.replicas),
        "calls": calls,
        "transport": "uvicorn+httptools on 127.0.0.1, httpx client in its own process",
        "fleet_generate_s": round(gen_s, 2),
        "direct_p50_ms": round(statistics.median(direct), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "empty_summary_p50_ms": round(statistics.median(empty_ms), 2),
        "summary_p50_ms": round(statistics.median(fleet_ms), 2),
        "summary_p99_ms": round(_p(fleet_ms, 0.99), 2),
        "summary_max_ms": round(max(fleet_ms), 2),
        # The client in the server's own process and event loop: its work
        # (sending, receiving and parsing ~100 kB) adds to every figure.
        "inprocess_client_p50_ms": round(statistics.median(results["fleet_inprocess"]), 2),
        "inprocess_client_p99_ms": round(_p(results["fleet_inprocess"], 0.99), 2),
        "p99_vs_empty": round(_p(fleet_ms, 0.99) / max(statistics.median(empty_ms), 1e-6), 1),
        # Full collections of the whole heap during the timed fleet calls
        # (both clients).
        "gc_full_collections": _FULL_COLLECTIONS[0],
        # The server's side of the reported figures: its CPU per call, and
        # its collections while they were timed. The rest of a call is the
        # client's (receiving and parsing the answer) and waiting for a core.
        "server_cpu_ms_per_call": round(server_cpu["fleet"], 2),
        "empty_server_cpu_ms_per_call": round(server_cpu["empty"], 2),
        "server_gc_while_timed": server_gc["fleet"],
        "answer_bytes": answer_bytes,
        "idle_replicas": len(body["idle_replicas"]),
        "nodes_ready": body["nodes"]["ready"],
        "heartbeats": f"each reporting node every {REPORT_EVERY_S:g} s, spread",
        "target_p99_ms": 50,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (about 20 s)")
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--calls", type=int, default=None)
    args = parser.parse_args()
    calls = args.calls or (100 if args.quick else 500)
    gc.callbacks.append(_count_full_collections)
    result = asyncio.run(run(args.nodes, args.gpus, calls))
    print(json.dumps(result), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
