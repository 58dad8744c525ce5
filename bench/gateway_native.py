"""The gateway's CPU per request and its workers' scaling, measured with native tools around it.

bench/gateway.py's load generator and upstream are Python processes, each
spending about what the gateway does per request: on a 2-core machine they
take the cores a second worker would need. Here the upstream is nginx
(``return 200`` of bench/gateway.py's canned chat completion) and the load
is wrk (closed loop: C connections, each sending its next request when the
last is answered), both spending ~10 us a request, so what is left is the
gateway's own cost, and a ceiling on what workers can gain here can be
computed from the measured costs.

For each system (llmgw with N workers; with ``--peer``, vllm-router and
sglang-router, round robin without keys, as bench/gateway.py runs them) and
each connection count of the ladder: requests per second, wrk's p99, and CPU
microseconds per request of the router's processes, nginx's and wrk's. With
one process per router (llmgw with one worker, the peers) the router is
pinned to the last core and nginx and wrk to the others, as bench/gateway.py
pins; with several workers nothing is pinned.

    python bench/gateway_native.py [--quick] [--workers 1,2] [--peer vllm-router,sglang-router]
                                   [--connections 1,8,32,128] [--seconds 5]

Last line: JSON with ``systems`` (per system and connection count ``rps``,
``p99_ms``, ``cpu_us_per_request`` of ``router``, ``upstream``,
``load``); ``max_rps_p99_under_50ms`` per system (the most any count held
with p99 under 50 ms and no failed request); with several worker counts,
``scaling`` (the most workers' rate over one worker's) and
``scaling_ceiling``: this machine's cores over one request's whole cost in
cores (router, upstream and load, at one worker's best count) times the
router's share -- the most N workers could reach here if they scaled
perfectly, so a ``scaling`` target above it cannot be met on this machine;
with ``--peer``, ``cpu_ratio_to_best_peer`` per connection count (llmgw's
one-process router CPU over the lowest peer's). Needs wrk and nginx
(Debian: ``apt-get install wrk nginx-light``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realkit import peers as gateway_peers

import gateway as python_bench  # bench/gateway.py: the canned request and answer, its gateway

P99_LIMIT_MS = 50.0


@dataclass
class Point:
    connections: int
    rps: float
    p99_ms: float
    failed: int
    cpu_us: dict[str, float]  # per request: router, upstream, load

    def held(self) -> bool:
        return self.p99_ms < P99_LIMIT_MS and not self.failed and self.rps > 0

    def as_json(self) -> dict[str, Any]:
        return {"rps": round(self.rps, 1), "p99_ms": round(self.p99_ms, 3),
                "failed": self.failed,
                "cpu_us_per_request": {k: round(v, 1) for k, v in self.cpu_us.items()}}  # fmt: skip


def _text(body: bytes | str) -> str:
    return body.decode() if isinstance(body, bytes) else body


def write_nginx(directory: Path, port: int) -> Path:
    answer = _text(python_bench.ANSWER_BODY)
    if "'" in answer:
        raise SystemExit("the canned answer holds a quote nginx's return cannot carry")
    conf = directory / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  client_body_temp_path {directory};
  server {{
    listen 127.0.0.1:{port};
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
}}
""")
    return conf


def write_lua(directory: Path, with_key: bool) -> Path:
    body = _text(python_bench.REQUEST_BODY)
    script = directory / ("post-key.lua" if with_key else "post.lua")
    lines = ['wrk.method = "POST"', f"wrk.body = [[{body}]]",
             'wrk.headers["Content-Type"] = "application/json"']  # fmt: skip
    if with_key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {python_bench.KEY}"')
    script.write_text("\n".join(lines) + "\n")
    return script


def _cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and its living descendants."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


_LATENCY = re.compile(r"^\s+99%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_RPS = re.compile(r"^Requests/sec:\s+([\d.]+)", re.M)
_COUNT = re.compile(r"^\s+(\d+) requests in", re.M)
_NON_2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_SOCKET = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def parse_wrk(output: str) -> tuple[int, float, float, int]:
    """(requests, per second, p99 in ms, failed) from ``wrk --latency``'s report."""
    count, rps, latency = _COUNT.search(output), _RPS.search(output), _LATENCY.search(output)
    if count is None or rps is None or latency is None:
        raise RuntimeError(f"wrk's report is not what was expected: {output[-400:]}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[latency.group(2)]
    non_2xx, errors = _NON_2XX.search(output), _SOCKET.search(output)
    failed = (int(non_2xx.group(1)) if non_2xx else 0) + (
        sum(int(n) for n in errors.groups()) if errors else 0)  # fmt: skip
    return int(count.group(1)), float(rps.group(1)), float(latency.group(1)) * scale, failed


def measure(
    url: str, script: Path, connections: int, seconds: float, router: psutil.Process,
    upstream: psutil.Process, load_cpus: set[int] | None,
) -> Point:  # fmt: skip
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script),
            url]  # fmt: skip
    before_router, before_upstream = _cpu_seconds(router), _cpu_seconds(upstream)
    load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=gateway_peers.pinner(load_cpus))  # fmt: skip
    assert load.stdout is not None
    output = load.stdout.read().decode(errors="replace")  # until wrk exits
    _, status, usage = os.wait4(load.pid, 0)  # its own CPU, to the last request
    load.returncode = os.waitstatus_to_exitcode(status)
    load_cpu = usage.ru_utime + usage.ru_stime
    requests, rps, p99_ms, failed = parse_wrk(output)
    per = 1e6 / max(requests, 1)
    return Point(connections, rps, p99_ms, failed, {
        "router": (_cpu_seconds(router) - before_router) * per,
        "upstream": (_cpu_seconds(upstream) - before_upstream) * per,
        "load": load_cpu * per,
    })  # fmt: skip


def start_llmgw(upstream_url: str, workers: int, cpus: set[int] | None) -> subprocess.Popen[str]:
    argv = [sys.executable, str(Path(python_bench.__file__)), "--role", "gateway",
            "--upstream-url", upstream_url, "--gateway-workers", str(workers)]  # fmt: skip
    if cpus:
        argv += ["--cpus", ",".join(map(str, sorted(cpus)))]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)


def run_system(
    name: str, url: str, script: Path, args: argparse.Namespace, router: psutil.Process,
    upstream: psutil.Process, load_cpus: set[int] | None,
) -> list[Point]:  # fmt: skip
    # Warm: connections, the gateway's config, the peers' first requests.
    measure(url, script, 4, 1, router, upstream, load_cpus)
    points = []
    for connections in args.connections:
        point = measure(url, script, connections, args.seconds, router, upstream, load_cpus)
        print(f"{name} c={connections}: {point.rps:.0f} req/s p99 {point.p99_ms:.2f} ms "
              f"cpu us/request {point.as_json()['cpu_us_per_request']}",
              file=sys.stderr, flush=True)  # fmt: skip
        points.append(point)
        if point.p99_ms >= P99_LIMIT_MS:
            break
    return points


def best(points: list[Point]) -> Point | None:
    held = [p for p in points if p.held()]
    return max(held, key=lambda p: p.rps) if held else None


def scaling_ceiling(one_worker: Point, cores: int) -> float:
    """The most N workers could gain over ``one_worker``'s rate on ``cores`` cores.

    One worker is held to a core, so its rate is one core's worth of router
    CPU per request; N workers share every core with nginx and wrk, so their
    rate is at most the cores over the whole cost of a request.
    """
    cost = one_worker.cpu_us
    whole = cost["router"] + cost["upstream"] + cost["load"]
    return cores * cost["router"] / whole if whole else 0.0


def counts(text: str) -> list[int]:
    """A comma-separated list of positive counts (an argparse type: a clear error otherwise)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each count must be at least 1")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two counts, 2 s each")
    parser.add_argument("--workers", type=counts, default=[1],
                        help="comma-separated llmgw worker counts")  # fmt: skip
    parser.add_argument("--peer", help="comma-separated: vllm-router, sglang-router")
    parser.add_argument("--connections", type=counts, help="comma-separated wrk connection counts")
    parser.add_argument("--seconds", type=float, help="per connection count (default 5)")
    args = parser.parse_args()
    missing = [tool for tool in ("wrk", "nginx") if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]  # fmt: skip
    if missing:
        raise SystemExit(f"needs {' and '.join(missing)}: apt-get install wrk nginx-light")
    args.seconds = args.seconds or (2.0 if args.quick else 5.0)
    args.connections = args.connections or ([1, 32] if args.quick else [1, 8, 32, 128])
    workers: list[int] = args.workers
    kinds = [p.strip() for p in args.peer.split(",")] if args.peer else []
    unknown = [p for p in kinds if p not in gateway_peers.KINDS]
    if unknown:
        parser.error(f"--peer: unknown {unknown}; known: {', '.join(gateway_peers.KINDS)}")
    cores = len(os.sched_getaffinity(0))
    router_cpus = {max(os.sched_getaffinity(0))} if cores > 1 else None
    other_cpus = set(os.sched_getaffinity(0)) - (router_cpus or set()) or None

    directory = Path(tempfile.mkdtemp(prefix="bench-gateway-native-"))
    upstream_port = gateway_peers.free_port()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    upstream_proc = psutil.Popen(
        [nginx, "-c", str(write_nginx(directory, upstream_port)), "-e", str(directory / "e.log")],
        preexec_fn=gateway_peers.pinner(other_cpus), start_new_session=True,
    )  # fmt: skip
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    results: dict[str, list[Point]] = {}
    try:
        time.sleep(0.5)
        with_key, without = write_lua(directory, True), write_lua(directory, False)
        for count in workers:
            pinned = count == 1
            gateway = start_llmgw(upstream_url, count, router_cpus if pinned else None)
            try:
                assert gateway.stdout is not None
                port = int(gateway.stdout.readline())
                name = f"llmgw-{count}"
                results[name] = run_system(
                    name, f"http://127.0.0.1:{port}/v1/chat/completions", with_key, args,
                    psutil.Process(gateway.pid), upstream_proc, other_cpus if pinned else None,
                )  # fmt: skip
            finally:
                gateway.terminate()
                gateway.wait(20)
        for kind_name in kinds:
            kind = gateway_peers.KINDS[kind_name]
            python = gateway_peers.find_python(kind)
            if python is None:
                print(f"--peer {kind_name}: not installed (scripts/bench-peers.sh)",
                      file=sys.stderr)  # fmt: skip
                continue
            probe = python_bench.LoadGenerator(upstream_port, auth=False, stream=False).request
            peer = gateway_peers.start(kind, python, upstream_url, router_cpus, probe)
            try:
                results[kind_name] = run_system(
                    kind_name, f"http://127.0.0.1:{peer.port}/v1/chat/completions", without, args,
                    psutil.Process(peer.process.pid), upstream_proc, other_cpus,
                )  # fmt: skip
            finally:
                gateway_peers.stop(peer)
    finally:
        upstream_proc.terminate()
        upstream_proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(summary(results, workers, kinds, cores)))
    return 0


def summary(
    results: dict[str, list[Point]], workers: list[int], kinds: list[str], cores: int
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "bench": "gateway_native",
        "cores": cores,
        "systems": {name: {str(p.connections): p.as_json() for p in points}
                    for name, points in results.items()},
        "max_rps_p99_under_50ms": {
            name: round(b.rps, 1) if (b := best(points)) else None
            for name, points in results.items()
        },
    }
    held = out["max_rps_p99_under_50ms"]
    if len(workers) > 1:
        fewest, most = f"llmgw-{min(workers)}", f"llmgw-{max(workers)}"
        if held.get(fewest) and held.get(most):
            out["scaling"] = round(held[most] / held[fewest], 3)
        one = best(results.get("llmgw-1", []))
        if one is not None:
            out["scaling_ceiling"] = round(scaling_ceiling(one, cores), 3)
    peers = [k for k in kinds if k in results]
    if peers and "llmgw-1" in results:
        ratios: dict[str, float | None] = {}
        for point in results["llmgw-1"]:
            theirs = [p.cpu_us["router"] for k in peers for p in results[k]
                      if p.connections == point.connections and p.held()]  # fmt: skip
            ratios[str(point.connections)] = (
                round(point.cpu_us["router"] / min(theirs), 3) if theirs and point.held() else None
            )
        out["cpu_ratio_to_best_peer"] = ratios
    return out


if __name__ == "__main__":
    sys.exit(main())
