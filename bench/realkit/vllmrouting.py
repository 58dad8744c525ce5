"""bench/routing_real.py --engine vllm: two vLLM CPU engines, estimated against exact cache state.

The same tenants, contexts and Poisson arrivals as the llama.cpp run
(routing_real.Setup), served by two ``vllm`` engines (vLLM's CPU build and the
starter model that ``make engines`` installs, started as the agent starts them:
VllmAdapter behind its engine guard, with an engine key, its KV-cache events on
an ipc socket that the guard relays) behind a real llmgw gateway, once per
router:

* ``prefix``: the endpoints carry no events URL, so the gateway routes on its
  estimated index (character blocks, sized from kv_capacity_tokens);
* ``prefix_exact``: the endpoints name each engine's events relay, so the
  gateway follows them (through the guard, with the key) and routes on the
  blocks each engine really holds, tokenising the prompt with the engine's
  /tokenize.

Each engine's KV cache is cut to a few tenants' contexts
(``--num-gpu-blocks-override``), so that where a prefix lives matters. The
engines start once; between routers their prefix caches are reset
(``/reset_prefix_cache``, a development route: VLLM_SERVER_DEV_MODE) and a
new gateway is started, so each router starts cold on the same engines.

Hit rate is vLLM's own word: its ``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total`` (prompt tokens found cached over prompt
tokens asked), summed over both engines for the run; TTFT is client side.
``tokenize_ms`` is what one /tokenize of a workload prompt took on an engine
(median of a few, asked before the runs): the round trip the exact router
adds before each pick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import routing as simbench
from routing_real import MODEL, START_TIMEOUT_S, Setup
from simfleet import children

from llmgw.sim import benchstats, loadgen
from llmgw.sim.workloads import TimedRequest
from realkit.runs import pooled, spread

ROUTERS = ("prefix", "prefix_exact")
BLOCK_SIZE = 32  # tokens per KV block (multiples of 32 are what vLLM's CPU backend prefers)
# KV blocks per engine: about three tenants' contexts. Gemma 3 is a hybrid model:
# vLLM keeps a block group per kind of layer (five sliding-window groups and one of
# full attention, each taking blocks from the one pool), so a ~640-token prompt
# holds ~20 blocks of each group: ~120.
CACHE_BLOCKS = 360
# What the estimated index is told a replica holds: those three contexts' tokens.
KV_CAPACITY_TOKENS = 2048
MAX_MODEL_LEN = 1024
# The engines' key: the bench, the gateway and the guards share it.
ENGINE_KEY = "bench-engine-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}
_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", re.M)


def vllm_python() -> str:
    """The vLLM environment's interpreter, as scripts/engines.sh env names it."""
    found = os.environ.get("LLMGW_ENGINE_VLLM")
    if found:
        return found
    root = Path(os.environ.get("LLMGW_ENGINES_DIR") or "~/.cache/llmgw/engines").expanduser()
    return str(root / "vllm" / "bin" / "python")


def model_dir() -> Path:
    root = Path(os.environ.get("LLMGW_ENGINES_DIR") or "~/.cache/llmgw/engines").expanduser()
    return root / "models" / "gemma-3-270m-hf"


def launch(port: int, engine_port: int, cpu: int) -> tuple[list[str], dict[str, str], Any]:
    """The agent's launch of one engine (VllmAdapter behind its guard on ``port``, the
    engine itself on loopback ``engine_port``), publishing its events for the guard."""
    from llmgw.agent.engines.base import LaunchContext
    from llmgw.agent.engines.vllm import VllmAdapter
    from llmgw.agent.replicalaunch import engine_launch, kv_events_endpoint
    from llmgw.agent.supervisor import engine_environment
    from llmgw.wire import EngineKind, ModelSpec, ReplicaAssignment, ShardAssignment, WeightsSource

    weights = model_dir()
    spec = ModelSpec(
        name=MODEL, engine=EngineKind.VLLM, kv_events=True,
        weights=WeightsSource(kind="local", path=str(weights)),
        kv_capacity_tokens=KV_CAPACITY_TOKENS,
        engine_args=["--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
                     "--block-size", str(BLOCK_SIZE),
                     "--num-gpu-blocks-override", str(CACHE_BLOCKS)],
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)},
    )  # fmt: skip
    assignment = ReplicaAssignment(
        replica_id=f"engine-{port}", model=spec, shard=ShardAssignment(node="bench"),
        engine_key=ENGINE_KEY,
    )
    ctx = LaunchContext(assignment=assignment, weights_path=str(weights), host="127.0.0.1",
                        port=port, kv_events=kv_events_endpoint(assignment.replica_id))
    adapter = VllmAdapter(vllm_python(), version="0.32.0")
    built, _ = engine_launch(adapter, ctx, lambda: engine_port)
    env = engine_environment(built.env, built.drop_env)
    # /reset_prefix_cache between routers (a development route, which no
    # catalog may turn on: the bench runs the engine itself).
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return built.argv, env, built.dialect


class Engine:
    def __init__(self, port: int, engine_port: int, cpu: int, log: Path) -> None:
        from llmgw.wire import kv_events_url

        self.url = f"http://127.0.0.1:{port}"  # its guard's
        self.events = kv_events_url(self.url)
        self.log = log
        argv, env, self.dialect = launch(port, engine_port, cpu)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    async def ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{self.url}/health", headers=AUTH) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM {self.url} not ready in {START_TIMEOUT_S:g} s")
            await asyncio.sleep(1.0)

    async def counters(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(f"{self.url}/metrics", headers=AUTH) as resp:
            text = await resp.text()
        out = {"hits": 0.0, "queries": 0.0}
        for name, value in _COUNTER.findall(text):
            out[name] += float(value)
        return out

    async def reset(self, session: aiohttp.ClientSession) -> None:
        async with session.post(f"{self.url}/reset_prefix_cache", headers=AUTH) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.url}/reset_prefix_cache: HTTP {resp.status}")

    def stop(self) -> None:
        children.stop([self.proc])


async def tokenize_ms(
    session: aiohttp.ClientSession, engine: Engine, request: TimedRequest
) -> float:
    """Milliseconds one /tokenize of a workload chat takes (the median of 7)."""
    body = {"model": MODEL, "messages": request.messages}
    took = []
    for _ in range(7):
        t0 = time.perf_counter()
        async with session.post(f"{engine.url}/tokenize", json=body, headers=AUTH) as resp:
            await resp.read()
        took.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(took), 2)


def start_gateway(router: str, engines: list[Engine]) -> tuple[subprocess.Popen[str], str]:
    endpoints = []
    for i, engine in enumerate(engines):
        endpoint: dict[str, Any] = {
            # The same ids for every router: a new prefix goes by rendezvous
            # hash of the ids among idle replicas, and different ids would
            # deal the tenants out differently (with ids named after the
            # router, the estimate's run got 3 + 3 tenants and the exact
            # one's 2 + 4, whose engine of 4 then evicted).
            "replica_id": f"vllm-{i}", "url": engine.url,
            "kv_capacity_tokens": KV_CAPACITY_TOKENS, "engine_key": ENGINE_KEY,
            "dialect": engine.dialect.model_dump(mode="json"),
        }  # fmt: skip
        if router == "prefix_exact":
            endpoint["kv_events"] = engine.events
        endpoints.append(endpoint)
    route = {"routing": "prefix", "endpoints": endpoints, "gateways": 1}
    script = Path(__file__).resolve().parents[1] / "routing.py"  # bench/routing.py
    proc = subprocess.Popen(
        [sys.executable, str(script), "--serve-gateways", json.dumps([route])],
        stdout=subprocess.PIPE, stderr=sys.stderr, text=True, start_new_session=True,
    )  # fmt: skip
    return proc, children.read_urls(proc, children.GATEWAY_MARKER, 1)[0]


async def ping(session: aiohttp.ClientSession, url: str, key: str = simbench.API_KEY) -> None:
    """One chat on ``url`` (a gateway's, with its API key, or an engine's, with its key)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{url}/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        await resp.read()


async def run_router(
    router: str, engines: list[Engine], requests: list[TimedRequest], setup: Setup
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        for engine in engines:
            await engine.reset(session)
        proc, url = start_gateway(router, engines)
        try:
            await ping(session, url)
            await asyncio.sleep(1.0)  # the followers connected (a SUB misses what came before)
            for engine in engines:
                await engine.reset(session)
            before = [await e.counters(session) for e in engines]
            t0 = time.monotonic()
            run = await loadgen.run(requests, [url], api_key=simbench.API_KEY,
                                    drain_s=setup.drain_s)  # fmt: skip
            elapsed = time.monotonic() - t0
            after = [await e.counters(session) for e in engines]
            outcomes = await gateway_outcomes(session, url)
        finally:
            children.stop([proc])
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    values = benchstats.ttfts(run.results, censor_at=run.ended_at)
    return {
        "hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_s": _round(benchstats.percentile(values, 50)),
        "ttft_mean_s": _round(statistics.fmean(values)) if values else None,
        "ttft_p90_s": _round(benchstats.percentile(values, 90)),
        "requests": len(run.results),
        "errors": sum(1 for r in run.results if r.error is not None),
        "cached_tokens": int(hits),
        "prompt_tokens": int(queries),
        "gateway_outcomes": outcomes,
        "elapsed_s": round(elapsed, 1),
    }


_OUTCOME = re.compile(r'llmgw_gateway_prefix_routing_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)')


async def gateway_outcomes(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(url.removesuffix("/v1") + "/metrics") as resp:
        text = await resp.text()
    return {name: int(float(value)) for name, value in _OUTCOME.findall(text)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


async def bench(
    setup: Setup, routers: list[str], port: int, quick: bool, repeat: int = 1
) -> dict[str, Any]:
    for router in routers:
        if router not in ROUTERS:
            raise SystemExit(f"unknown router {router!r} for --engine vllm; known: {ROUTERS}")
    requests = setup.workload()
    folder = Path(tempfile.mkdtemp(prefix="bench-routing-vllm-"))
    print(f"workload: {len(requests)} streamed chats at {setup.rate:g} req/s over"
          f" {setup.tenants} tenants; 2 vLLM engines, {CACHE_BLOCKS} blocks of {BLOCK_SIZE}"
          f" tokens each; logs in {folder}", file=sys.stderr)  # fmt: skip
    engines = [Engine(port + i, port + 100 + i, i % max(1, os.cpu_count() or 1),
                      folder / f"vllm-{i}.log") for i in range(2)]  # fmt: skip
    out: dict[str, Any] = {"bench": "routing_real", "engine": "vllm", "quick": quick,
                           "seed": setup.seed}  # fmt: skip
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(e.ready(session) for e in engines))
            for engine in engines:  # the first request's warm-up is not routing
                await ping(session, f"{engine.url}/v1", ENGINE_KEY)
            out["tokenize_ms"] = await tokenize_ms(session, engines[0], requests[0])
        runs: dict[str, list[dict[str, Any]]] = {router: [] for router in routers}
        for _ in range(repeat):  # the routers take turns, so drift hits each alike
            for router in routers:
                row = await run_router(router, engines, requests, setup)
                runs[router].append(row)
                print(f"{router:13s} hit {row['hit_rate']}  p50 {row['ttft_p50_s']}  mean"
                      f" {row['ttft_mean_s']}  p90 {row['ttft_p90_s']}  errors {row['errors']}"
                      f"  outcomes {row['gateway_outcomes']}  ({row['elapsed_s']} s)",
                      file=sys.stderr)  # fmt: skip
    finally:
        for engine in engines:
            engine.stop()
    for router, rows in runs.items():
        out[router] = rows[0] if repeat == 1 else pooled(rows)
    out["verdict"] = verdict(out)
    if repeat > 1:
        out["verdict_per_run"] = [
            verdict({r: runs[r][i] for r in routers}) for i in range(repeat)
        ]
    out["setup"] = setup.__dict__ | {"block_size": BLOCK_SIZE, "cache_blocks": CACHE_BLOCKS}
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


def verdict(out: dict[str, Any]) -> dict[str, Any] | None:
    """Exact cache state at least as good as the estimate: hit rate >=, TTFT p90 <=.

    Over repeated runs, means are compared within the estimate's own spread
    (the control: what the same router moves by from run to run on the same
    engines); a single run is compared as it is.
    """
    exact, estimated = out.get("prefix_exact"), out.get("prefix")
    if exact is None or estimated is None:
        return None
    hit_slack = spread(estimated.get("hit_rate_range"))
    p90_slack = spread(estimated.get("ttft_p90_s_range"))
    hit = (exact["hit_rate"] or 0) >= (estimated["hit_rate"] or 0) - hit_slack
    p90 = (exact["ttft_p90_s"] or 0) <= (estimated["ttft_p90_s"] or 0) + p90_slack
    return {"ok": hit and p90, "hit_rate_at_or_above": hit, "ttft_p90_at_or_below": p90,
            "control_spread": {"hit_rate": hit_slack, "ttft_p90_s": p90_slack}}  # fmt: skip

