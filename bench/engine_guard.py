"""What the engine guard (llmgw.agent.engineguard) adds to a request through the gateway.

Three processes besides this one, as on a node and a gateway host:

* engine: the simulated engine (``python -m llmgw.sim.engine``) with an
  engine key, on loopback;
* guard: an :class:`~llmgw.agent.engineguard.EngineGuard` in front of it, in a
  process of its own on the loop the agent runs (uvloop where installed),
  as the agent runs it;
* gateway: the real gateway (``bench/gateway.py``'s server settings) with two
  models on that one engine: ``direct`` routes to the engine's own port,
  ``guarded`` to the guard's, both with the engine key.

This process sends the same requests to both models, one at a time, in
alternating slices (so background noise on a shared machine falls on both
alike): a small non-streamed chat (1 output token) and a streamed chat whose
time to the first token (TTFT: the first content chunk) is timed. Latency is
from the request's send to its whole answer, over keep-alive connections.

    python bench/engine_guard.py [--quick] [--requests 400] [--tls]

``--tls``: the guard terminates TLS with a fresh certificate (the gateway
verifies it), against the engine's plain loopback port as direct baseline.

Last line: JSON with p50/p99 latency and TTFT p50/p99 per side, the added
milliseconds (guarded minus direct) and the ratios guarded/direct.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from llmgw.sim.benchstats import percentile

ENGINE_KEY = "engine-key-bench-0123456789abcdefghijklmnopqrs"
API_KEY = "sk-llmgw-bench-0123456789abcdefghijklmnopqrstuv"
SERVED = "sim"
# Fast enough that the guard's share shows: 1 ms to the first token.
SIM_PARAMS = {"startup_s": 0.0, "decode_ms_per_token": 1.0, "prefill_tokens_per_s": 1e6}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nothing listens on {port} after {timeout_s:g} s") from None
            await asyncio.sleep(0.05)


# -- the guard's process ------------------------------------------------------------


def run_guard(port: int, engine_port: int, cert: str | None, key: str | None) -> None:
    from llmgw.agent.engineguard import EngineGuard
    from llmgw.agent.engines.base import EngineTls
    from llmgw.serving import run

    tls = EngineTls(cert, key) if cert and key else None

    async def serve() -> None:
        guard = EngineGuard(ENGINE_KEY, "127.0.0.1", engine_port, tls=tls)
        await guard.start("127.0.0.1", port)
        await asyncio.Event().wait()

    run(serve())


# -- the gateway's process ------------------------------------------------------------


def run_gateway(port: int, engine_url: str, guard_url: str, ca_file: str | None) -> None:
    import uvicorn

    from llmgw import secrets, wire
    from llmgw.gateway.app import Gateway, freeze_startup_objects
    from llmgw.gateway.link import MemoryLink
    from llmgw.http.server import server_config
    from llmgw.serving import run, start_server

    def route(name: str, url: str) -> Any:
        endpoint = wire.Endpoint(replica_id=name, url=url, engine_key=ENGINE_KEY)
        return wire.ModelRoute(name=name, served_name=SERVED, routing="least-loaded",
                               endpoints=[endpoint])

    config = wire.GatewayConfig(
        routing=wire.RoutingTable(
            version=1, models=[route("direct", engine_url), route("guarded", guard_url)],
            # The gateway verifies https engines against the fleet's CA.
            engine_ca=Path(ca_file).read_text() if ca_file else None,
        ),
        keys=[wire.ApiKeyInfo(key_id="bench", secret_hash=secrets.hash_secret(API_KEY))],
    )

    async def serve() -> None:
        gateway = Gateway(MemoryLink(config, poll_timeout_s=3600))
        await gateway.start()
        await gateway.wait_configured(10)
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        served = server_config(gateway, log_level="warning", backlog=1024,
                               timeout_keep_alive=75)
        served.load()
        freeze_startup_objects()
        await (await start_server(uvicorn.Server(served), [sock]))

    run(serve())


# -- the measurement ------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, model: str, stream: bool) -> float:
    """One chat; the whole answer's latency in ms, or with ``stream`` the TTFT in ms."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": 1 if not stream else 4,
        "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
    }
    if stream:
        body["stream"] = True
    began = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"{model}: HTTP {resp.status}: {await resp.text()}")
        if not stream:
            await resp.read()
            return (time.perf_counter() - began) * 1000
        first: float | None = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = (time.perf_counter() - began) * 1000
        if first is None:
            raise SystemExit(f"{model}: a stream without content")
        return first


def summary(values: list[float]) -> dict[str, float]:
    return {name: round(percentile(values, q) or 0.0, 3)
            for name, q in (("p50_ms", 50), ("p99_ms", 99))}


async def measure(gateway_port: int, requests: int, slice_n: int = 10) -> dict[str, Any]:
    url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    results: dict[str, dict[str, list[float]]] = {
        kind: {"direct": [], "guarded": []} for kind in ("latency", "ttft")
    }
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        for model in ("direct", "guarded"):  # warm up both paths and connections
            for stream in (False, True):
                for _ in range(20):
                    await one(session, url, model, stream)
        done = 0
        while done < requests:
            for kind, stream in (("latency", False), ("ttft", True)):
                for model in ("direct", "guarded"):
                    for _ in range(slice_n):
                        results[kind][model].append(await one(session, url, model, stream))
            done += slice_n
    out: dict[str, Any] = {"requests_per_side": done}
    for kind, sides in results.items():
        direct, guarded = summary(sides["direct"]), summary(sides["guarded"])
        out[kind] = {"direct": direct, "guarded": guarded}
        for q in ("p50", "p99"):
            out[f"{kind}_added_{q}_ms"] = round(guarded[f"{q}_ms"] - direct[f"{q}_ms"], 3)
            out[f"{kind}_ratio_{q}"] = round(guarded[f"{q}_ms"] / direct[f"{q}_ms"], 3)
    return out


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per side and kind")
    parser.add_argument("--quick", action="store_true", help="60 requests per side and kind")
    parser.add_argument("--tls", action="store_true", help="the guard terminates TLS")
    parser.add_argument("--role", choices=["guard", "gateway"])
    parser.add_argument("--ports", default="")
    parser.add_argument("--urls", default="")
    parser.add_argument("--cert", default="")
    parser.add_argument("--key", default="")
    parser.add_argument("--ca", default="")
    args = parser.parse_args()
    if args.role == "guard":
        port, engine_port = map(int, args.ports.split(","))
        run_guard(port, engine_port, args.cert or None, args.key or None)
        return
    if args.role == "gateway":
        engine_url, guard_url = args.urls.split(",")
        run_gateway(int(args.ports), engine_url, guard_url, args.ca or None)
        return
    engine_port, guard_port, gateway_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tls_args: list[str] = []
        scheme = "http"
        if args.tls:
            from llmgw.servertls import ensure_server_tls

            server = ensure_server_tls(Path(tmp), ["127.0.0.1"])
            tls_args = ["--cert", str(server.cert_file), "--key", str(server.key_file),
                        "--ca", str(server.ca_file)]
            scheme = "https"
        try:
            procs.append(spawn(
                "-m", "llmgw.sim.engine", "--host", "127.0.0.1", "--port", str(engine_port),
                "--model", SERVED, "--params-json", json.dumps(SIM_PARAMS),
                env={"LLMGW_ENGINE_KEY": ENGINE_KEY},
            ))
            procs.append(spawn(__file__, "--role", "guard",
                               "--ports", f"{guard_port},{engine_port}", *tls_args))
            urls = f"http://127.0.0.1:{engine_port},{scheme}://127.0.0.1:{guard_port}"
            procs.append(spawn(__file__, "--role", "gateway", "--ports", str(gateway_port),
                               "--urls", urls, *(tls_args[-2:] if args.tls else [])))
            for port in (engine_port, guard_port, gateway_port):
                asyncio.run(wait_port(port))
            began = time.monotonic()
            result = asyncio.run(measure(gateway_port, 60 if args.quick else args.requests))
            result["tls"] = args.tls
            result["seconds"] = round(time.monotonic() - began, 1)
            print(json.dumps(result))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                if proc.poll() is None:
                    proc.kill()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
    sys.exit(0)
