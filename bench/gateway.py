"""What the gateway adds to a request: latency at several rates, and the rate it holds.

Three processes, so the gateway has a core of its own (``--pin`` pins it to
one core and the others to the rest, for machines with cores to spare):

* upstream: a minimal OpenAI-compatible server (raw asyncio + uvloop, one
  canned chat completion with usage), as fast as a Python server gets;
* gateway: the real `Gateway` under uvicorn with `llmgw gateway`'s server
  settings (llmgw.http.connection: httptools, guarded heads, uvloop), configured
  through an in-memory link with one model, one API key, prefix routing;
* load generator (this process): a raw HTTP/1.1 keep-alive client sending an
  open-loop, constant-rate load (a new connection when all are busy, so a
  slow server cannot slow the sender down).

At each rate the same load is sent directly to the upstream and through the
gateway, alternately; the added latency at a percentile is the difference of
the two percentiles. Latency is measured from the moment the request was
written to the moment its whole answer was read. The gateway's own overhead
header (`x-llmgw-overhead-ms`) is summarised too. The ramp then raises the
rate until the added p99 reaches 50 ms, requests fail, or the sender cannot
reach the rate. ``max_rps_p99_under_50ms`` is the highest rate at which that
rate and every lower one measured held: a fixed rate that failed caps it,
and the ramp then does not run (``ramp_stopped_by`` says what failed).

    python bench/gateway.py [--quick] [--seconds 8] [--pin] [--nice -5]
                            [--stream] [--rates 1000 --no-ramp] [--workers 1,2]
                            [--peer vllm-router,sglang-router]

``--workers 1,2``: the whole measurement once per worker count, the gateway
served by that many processes on one port (``llmgw gateway --workers``'s
pool: llmgw.cli.workers); the last line then holds
``max_rps_p99_under_50ms`` per worker count, ``scaling`` (the most workers'
rate over the fewest's), the load average, and each count's full result.

``--stream``: streamed chat with ``stream_options.include_usage``; the
upstream answers an SSE stream (chunked, as engines do): the role and first
token at once, then after 1 ms five more tokens, the finish, the usage event
and ``[DONE]``. Latency is then to the end of the stream, and TTFT (to the
first body byte) is measured too.

``--peer vllm-router,sglang-router``: after llmgw, the same rates (no ramp)
through vLLM's and SGLang's Rust routers (PyPI), each started on the same
upstream, round robin, without API keys, pinned to one core
(bench/realkit/peers.py; scripts/bench-peers.sh installs them when they are
missing, a peer that cannot be had is reported as skipped). The last line
then also holds ``systems``: per system and rate ``cpu_ms_per_request``,
``added_p50_ms``, ``added_p99_ms``; and ``cpu_ratio_to_best_peer_at_1000``
and ``_at_2000``: llmgw's CPU per request over the lowest peer's (at or
below 1: llmgw spends no more than any peer).

Last line: JSON with added_p50_ms_at_1000, added_p99_ms_at_1000,
cpu_ms_per_request_at_1000 (the gateway process's CPU time over the
requests it served at that rate), max_rps_p99_under_50ms (and the per-rate
table); with ``--stream`` also added_ttft_p50_ms_at_1000.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import psutil
import uvloop

from llmgw.sim.benchstats import percentile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from realkit import peers as gateway_peers  # bench/realkit (tests load this file by path)

MODEL = "bench"
KEY = "sk-llmgw-bench-0123456789abcdefghijklmnopqrstuv"
REQUEST_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello to the benchmark in one short sentence."},
        ],
        "max_tokens": 16,
    }
).encode()
ANSWER_BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, benchmark!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 31, "completion_tokens": 5, "total_tokens": 36},
    }
).encode()


def _sse(payload: dict[str, Any]) -> bytes:
    event = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return hex(len(event))[2:].encode() + b"\r\n" + event + b"\r\n"


def _stream_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000,
        "model": MODEL, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }  # fmt: skip


STREAM_USAGE = {"prompt_tokens": 31, "completion_tokens": 6, "total_tokens": 37}
STREAM_REQUEST_BODY = json.dumps(
    {**json.loads(REQUEST_BODY), "stream": True, "stream_options": {"include_usage": True}}
).encode()
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# Written at once: the answer's start (what TTFT measures).
STREAM_FIRST = _sse(_stream_chunk({"role": "assistant", "content": "Hello"}))
# Written 1 ms later: the rest of the answer, in one write.
STREAM_REST = (
    b"".join(_sse(_stream_chunk({"content": word})) for word in (",", " bench", "mark", "!", ""))
    + _sse(_stream_chunk({}, "stop"))
    + _sse({**_stream_chunk({}), "choices": [], "usage": STREAM_USAGE})
    + b"e\r\ndata: [DONE]\n\n\r\n"
    + b"0\r\n\r\n"
)


# ---------------------------------------------------------------------------
# Upstream: the fastest OpenAI-shaped answer a Python process can give
# ---------------------------------------------------------------------------


class _UpstreamProtocol(asyncio.Protocol):
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(ANSWER_BODY)).encode()
        + b"\r\n\r\n"
        + ANSWER_BODY
    )

    stream = False  # set in the upstream process by --stream

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance.
        self.transport = cast(asyncio.Transport, transport)

    def _rest(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(STREAM_REST)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            length = _content_length(buffer[:end])
            if len(buffer) < end + 4 + length:
                break
            buffer = buffer[end + 4 + length :]
            assert self.transport is not None
            if self.stream:
                # One request at a time per connection (the clients here never pipeline).
                self.transport.write(STREAM_HEAD + STREAM_FIRST)
                asyncio.get_running_loop().call_later(0.001, self._rest)
            else:
                self.transport.write(self.response)
        self.buffer = buffer


def _content_length(head: bytes) -> int:
    lower = head.lower()
    at = lower.find(b"content-length:")
    if at < 0:
        return 0
    stop = lower.find(b"\r\n", at)
    return int(lower[at + 15 : stop if stop >= 0 else None])


async def _run_upstream(stream: bool) -> None:
    _UpstreamProtocol.stream = stream
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_UpstreamProtocol, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------
# Gateway: the real one, under uvicorn
# ---------------------------------------------------------------------------


def gateway_config(upstream_url: str) -> Any:
    """The gateway's config: one model on ``upstream_url``, one API key, prefix routing."""
    from llmgw import secrets, wire

    return wire.GatewayConfig(
        routing=wire.RoutingTable(
            version=1,
            models=[
                wire.ModelRoute(
                    name=MODEL,
                    served_name=MODEL,
                    endpoints=[wire.Endpoint(replica_id="up", url=upstream_url)],
                )
            ],
        ),
        keys=[wire.ApiKeyInfo(key_id="bench", secret_hash=secrets.hash_secret(KEY))],
    )


async def _run_gateway(
    upstream_url: str, worker_of: int = 1, listen_fd: int | None = None,
    lifeline_fd: int | None = None,
) -> None:
    """One gateway process: alone (prints its port), or one of ``worker_of`` workers of a
    pool (llmgw.cli.workers) serving the socket ``listen_fd`` (prints ``ready``)."""
    import logging

    import uvicorn

    try:
        from llmgw.http.server import server_config
    except ImportError:  # a tree from before llmgw.http (old/new comparisons)
        from llmgw.cli.httpserver import server_config  # type: ignore[no-redef]

    # What `llmgw gateway` serves with; a tree where llmgw's own protocol was
    # not the default yet named it apart (old/new comparisons).
    with contextlib.suppress(ImportError, AttributeError):
        server_config = importlib.import_module("llmgw.cli.leanhttp").gateway_server_config
    from llmgw.gateway.app import Gateway, freeze_startup_objects
    from llmgw.gateway.link import MemoryLink
    from llmgw.serving import start_server

    logging.basicConfig(level=logging.WARNING)
    config = gateway_config(upstream_url)
    settings = None
    if worker_of > 1:
        from llmgw.gateway.settings import GatewaySettings

        settings = GatewaySettings(workers=worker_of)
    gateway = Gateway(MemoryLink(config, poll_timeout_s=3600), settings)
    await gateway.start()
    await gateway.wait_configured(10)
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
    # The settings `llmgw gateway` serves with (llmgw's own protocol included),
    # loaded before the freeze as it does.
    served = server_config(
        gateway, log_level="warning", backlog=4096,
        # The load generator keeps idle connections between rates; they
        # must not close under its feet.
        timeout_keep_alive=75,
    )  # fmt: skip
    served.load()
    freeze_startup_objects()
    server = uvicorn.Server(served)
    task = await start_server(server, [sock])
    if lifeline_fd is not None:
        from llmgw.cli.workers import watch_lifeline

        watch_lifeline(lifeline_fd, lambda: setattr(server, "should_exit", True))
        print("ready", flush=True)
    else:
        print(sock.getsockname()[1], flush=True)
    await task


def _run_pool(upstream_url: str, workers: int) -> None:
    """``workers`` gateway processes on one port, as ``llmgw gateway --workers`` runs them."""
    from llmgw.cli.workers import WorkerPool

    def command(index: int, listen_fd: int, lifeline_fd: int) -> list[str]:
        return [sys.executable, __file__, "--role", "gateway", "--upstream-url", upstream_url,
                "--gateway-workers", str(workers), "--listen-fd", str(listen_fd),
                "--lifeline-fd", str(lifeline_fd)]

    pool = WorkerPool("127.0.0.1", 0, workers, command, stop_grace_s=5.0)
    pool.run(started=lambda p: print(p.port, flush=True))


# ---------------------------------------------------------------------------
# Load generator
# ---------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""
        self.waiter: asyncio.Future[tuple[int, float | None]] | None = None
        self.transport: asyncio.Transport | None = None
        self.first_byte_at = 0.0  # perf_counter when the answer's body began

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            self.buffer = buffer
            return
        head = buffer[:end]
        if not self.first_byte_at and len(buffer) > end + 4:
            self.first_byte_at = time.perf_counter()
        if b"chunked" in head.lower():
            # A stream (the clients here never pipeline): whole at its last chunk.
            if not buffer.endswith(b"\r\n0\r\n\r\n"):
                self.buffer = buffer
                return
            self.buffer = b""
        else:
            length = _content_length(head)
            if len(buffer) < end + 4 + length:
                self.buffer = buffer
                return
            self.buffer = buffer[end + 4 + length :]
        status = int(head[9:12])
        overhead = None
        at = head.find(b"x-llmgw-overhead-ms: ")
        if at >= 0:
            overhead = float(head[at + 21 : head.find(b"\r\n", at)])
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((status, overhead))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))


@dataclass
class Phase:
    rate: int
    target: str
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    overheads_ms: list[float] = field(default_factory=list)
    errors: int = 0
    sent: int = 0
    elapsed_s: float = 0.0
    late_sends: int = 0

    def pct(self, q: float, values: list[float] | None = None) -> float:
        value = percentile(self.latencies_ms if values is None else values, q * 100)
        return float("nan") if value is None else value

    @property
    def achieved(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s else 0.0


class LoadGenerator:
    def __init__(self, port: int, *, auth: bool, stream: bool = False) -> None:
        self.port = port
        body = STREAM_REQUEST_BODY if stream else REQUEST_BODY
        headers = [
            b"POST /v1/chat/completions HTTP/1.1",
            b"Host: 127.0.0.1",
            b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode(),
        ]
        if auth:
            headers.append(b"Authorization: Bearer " + KEY.encode())
        self.request = b"\r\n".join(headers) + b"\r\n\r\n" + body
        self.idle: list[_Client] = []

    async def _connect(self) -> _Client:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_Client, "127.0.0.1", self.port)
        return protocol

    async def open(self, count: int) -> None:
        self.idle.extend(await asyncio.gather(*(self._connect() for _ in range(count))))

    def close(self) -> None:
        for client in self.idle:
            if client.transport is not None:
                client.transport.close()
        self.idle.clear()

    async def _one(self, phase: Phase) -> None:
        client = None
        while self.idle:
            candidate = self.idle.pop()
            if candidate.transport is not None and not candidate.transport.is_closing():
                client = candidate
                break
        if client is None:
            try:
                client = await self._connect()
            except OSError:
                phase.errors += 1
                return
        loop = asyncio.get_running_loop()
        client.waiter = loop.create_future()
        client.first_byte_at = 0.0
        started = time.perf_counter()
        assert client.transport is not None
        client.transport.write(self.request)
        try:
            status, overhead = await client.waiter
        except ConnectionError:
            phase.errors += 1
            return
        phase.latencies_ms.append((time.perf_counter() - started) * 1000.0)
        if client.first_byte_at:
            phase.ttfts_ms.append((client.first_byte_at - started) * 1000.0)
        if overhead is not None:
            phase.overheads_ms.append(overhead)
        if status != 200:
            phase.errors += 1
        self.idle.append(client)

    async def run(
        self, rate: int, seconds: float, phase: Phase, pending: set[asyncio.Task[None]]
    ) -> None:
        """Send ``rate`` requests per second for ``seconds`` (open loop), into ``phase``."""
        interval = 1.0 / rate
        total = max(1, int(rate * seconds))
        loop = asyncio.get_running_loop()
        begin = time.perf_counter()
        for index in range(total):
            due = begin + index * interval
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            elif now - due > 0.005:
                phase.late_sends += 1
            task = loop.create_task(self._one(phase))
            pending.add(task)
            task.add_done_callback(pending.discard)
            phase.sent += 1
        phase.elapsed_s += time.perf_counter() - begin


async def interleaved(
    direct: LoadGenerator, through: LoadGenerator, rate: int, seconds: float
) -> tuple[Phase, Phase]:
    """The same load, direct and through the gateway, in alternating half-second slices.

    Alternating keeps both sides exposed to the same background noise (other
    processes on a shared machine), which a direct-then-gateway order does not.
    """
    d, g = Phase(rate, "direct"), Phase(rate, "gateway")
    pending_d: set[asyncio.Task[None]] = set()
    pending_g: set[asyncio.Task[None]] = set()
    slices = max(1, round(seconds / 0.5))
    for _ in range(slices):
        await direct.run(rate, seconds / slices, d, pending_d)
        await through.run(rate, seconds / slices, g, pending_g)
    for phase, pending in ((d, pending_d), (g, pending_g)):
        if pending:
            await asyncio.wait(pending, timeout=min(30.0, 4 * seconds))
        # Unanswered by now counts as failed, not as missing from the percentiles.
        phase.errors += sum(1 for task in pending if not task.done())
        for task in pending:
            task.cancel()
    return d, g


# ---------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------


def _spawn(
    role: str, *args: str, cpus: set[int] | None, ready_lines: int = 0
) -> tuple[subprocess.Popen[str], int]:
    """Start a role; its port. ``ready_lines``: workers that must say ``ready`` first."""
    command = [sys.executable, __file__, "--role", role, *args]
    if cpus:
        command += ["--cpus", ",".join(map(str, sorted(cpus)))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    for _ in range(ready_lines):
        if process.stdout.readline().strip() != "ready":
            line = ""
    if not line.strip():
        process.kill()
        raise SystemExit(f"{role} process did not start")
    return process, int(line)


def _cpu_s(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and its children (a pool's workers)."""
    total = 0.0
    for each in [process, *process.children()]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = each.cpu_times()
            total += times.user + times.system
    return total


def _row(rate: int, direct: Phase, through: Phase) -> dict[str, Any]:
    return {
        "rate": rate,
        "achieved_rps": round(through.achieved, 1),
        "direct_p50_ms": round(direct.pct(0.50), 3),
        "direct_p99_ms": round(direct.pct(0.99), 3),
        "gateway_p50_ms": round(through.pct(0.50), 3),
        "gateway_p99_ms": round(through.pct(0.99), 3),
        "added_p50_ms": round(through.pct(0.50) - direct.pct(0.50), 3),
        "added_p99_ms": round(through.pct(0.99) - direct.pct(0.99), 3),
        "overhead_header_p50_ms": round(through.pct(0.50, through.overheads_ms), 3),
        "overhead_header_p99_ms": round(through.pct(0.99, through.overheads_ms), 3),
        "added_ttft_p50_ms": round(
            through.pct(0.50, through.ttfts_ms) - direct.pct(0.50, direct.ttfts_ms), 3
        ),
        "errors": through.errors + direct.errors,
        "late_sends": through.late_sends + direct.late_sends,
    }


async def _measure(
    args: argparse.Namespace, upstream_port: int, gateway_port: int, gateway_pid: int,
    ramp: bool = True,
) -> dict[str, Any]:
    gateway_process = psutil.Process(gateway_pid)
    direct = LoadGenerator(upstream_port, auth=False, stream=args.stream)
    through = LoadGenerator(gateway_port, auth=True, stream=args.stream)
    await direct.open(32)
    await through.open(32)
    seconds = args.seconds
    # Warm-up: connection pools on both sides, and the interpreter's caches.
    await interleaved(direct, through, 300, 1.0)

    async def both(rate: int) -> dict[str, Any]:
        cpu_before = _cpu_s(gateway_process)
        d, g = await interleaved(direct, through, rate, seconds)
        cpu_after = _cpu_s(gateway_process)
        row = _row(rate, d, g)
        # CPU the gateway process (and its workers) spent per request: unlike
        # latency, barely disturbed by other jobs on a shared machine.
        used = cpu_after - cpu_before
        row["gateway_cpu_us_per_request"] = round(used / max(1, g.sent) * 1e6, 1)
        row["cpu_ms_per_request"] = round(used / max(1, g.sent) * 1e3, 4)
        print(
            f"rate {rate:>5}/s  achieved {row['achieved_rps']:>7}/s   "
            f"direct p50 {row['direct_p50_ms']:6.3f} p99 {row['direct_p99_ms']:7.3f} ms   "
            f"gateway p50 {row['gateway_p50_ms']:6.3f} p99 {row['gateway_p99_ms']:7.3f} ms   "
            f"added p50 {row['added_p50_ms']:6.3f} p99 {row['added_p99_ms']:7.3f} ms   "
            f"header p50 {row['overhead_header_p50_ms']:.3f} p99 "
            f"{row['overhead_header_p99_ms']:.3f} ms   gateway cpu "
            f"{row['gateway_cpu_us_per_request']} us/req   "
            + (f"added ttft p50 {row['added_ttft_p50_ms']:.3f} ms   " if args.stream else "")
            + f"errors {row['errors']}",
            flush=True,
        )
        return row

    rows = [await both(rate) for rate in args.rates]
    at_1000 = next((r for r in rows if r["rate"] == 1000), None)
    best, limited_by = max_rate_held(rows)
    # The ramp goes on only from rates that all held: a failed lower rate
    # caps the figure, whatever a higher one did.
    for rate in args.ramp if ramp and limited_by == NOT_REACHED else []:
        row = await both(rate)
        if not _holds(row) and row["achieved_rps"] >= 0.97 * rate:
            # One retry: on a shared machine a single stall of another job
            # can push one short phase's p99 over the line.
            print(f"rate {rate}: retrying once", flush=True)
            row = await both(rate)
        rows.append(row)
        best, limited_by = max_rate_held(rows)
        if limited_by != NOT_REACHED:
            break
    direct.close()
    through.close()
    result = {
        "added_p50_ms_at_1000": at_1000["added_p50_ms"] if at_1000 else None,
        "added_p99_ms_at_1000": at_1000["added_p99_ms"] if at_1000 else None,
        "max_rps_p99_under_50ms": best,
        "ramp_stopped_by": limited_by,
        "overhead_header_p50_ms_at_1000": at_1000["overhead_header_p50_ms"] if at_1000 else None,
        "overhead_header_p99_ms_at_1000": at_1000["overhead_header_p99_ms"] if at_1000 else None,
        "gateway_cpu_us_per_request_at_1000": (
            at_1000["gateway_cpu_us_per_request"] if at_1000 else None
        ),
        "cpu_ms_per_request_at_1000": at_1000["cpu_ms_per_request"] if at_1000 else None,
        "stream": args.stream,
        **(
            {"added_ttft_p50_ms_at_1000": at_1000["added_ttft_p50_ms"] if at_1000 else None}
            if args.stream
            else {}
        ),
        "seconds_per_phase": seconds,
        "pinned": args.pin,
        "nice": args.nice,
        "cpus": os.cpu_count(),
        # Others' work on a shared machine moves the rates held (not the CPU per request).
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "rows": rows,
    }
    return result


NOT_REACHED = "not reached"


def max_rate_held(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """The highest rate at which it, and every lower rate measured, held; and what stopped it.

    A rate holds with no errors, added p99 under 50 ms and the rate reached.
    Rates are taken in order, so a rate that failed caps the figure even
    when a higher one held (a stall that happened to miss the higher one
    does not make the gateway hold it). 0 when the lowest rate failed;
    ``not reached`` when none failed.
    """
    best = 0
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not _holds(row):
            return best, (
                "errors" if row["errors"] else
                "rate not reached" if row["achieved_rps"] < 0.97 * row["rate"] else
                "p99 added >= 50 ms"
            )  # fmt: skip
        best = row["rate"]
    return best, NOT_REACHED


def _holds(row: dict[str, Any]) -> bool:
    return bool(
        row["errors"] == 0
        and row["added_p99_ms"] < 50.0
        and row["achieved_rps"] >= 0.97 * row["rate"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute in all")
    parser.add_argument("--seconds", type=float, default=None, help="per rate and target")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the gateway to a core of its own (worth it with 4+ idle cores; on a shared"
        " 2-core VM it only takes half the machine away from the gateway)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness for all three processes (e.g. -5 on a machine busy with other work)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="streamed chat with include_usage (SSE)"
    )
    parser.add_argument(
        "--rates", help="comma-separated rates to measure (default 100,500,1000,2000)"
    )
    parser.add_argument("--no-ramp", action="store_true", help="skip the ramp to the max rate")
    parser.add_argument(
        "--workers", help="comma-separated gateway worker counts to measure in turn (e.g. 1,2:"
        " llmgw gateway --workers N's pool); max_rps_p99_under_50ms for each"
    )
    parser.add_argument(
        "--peer", help="comma-separated routers measured after llmgw on the same upstream:"
        " vllm-router, sglang-router (installed by scripts/bench-peers.sh when missing)"
    )
    parser.add_argument(
        "--no-install", action="store_true", help="--peer: skip a router not installed"
    )
    parser.add_argument("--role", choices=["upstream", "gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--gateway-workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lifeline-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument("--upstream-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        gateway_peers.pin({int(c) for c in args.cpus.split(",")} if args.cpus else None)
        if args.role == "upstream":
            uvloop.run(_run_upstream(args.stream))
        elif args.gateway_workers > 1 and args.listen_fd is None:
            _run_pool(args.upstream_url, args.gateway_workers)
        else:
            uvloop.run(_run_gateway(args.upstream_url, args.gateway_workers, args.listen_fd,
                                    args.lifeline_fd))
        return
    if args.seconds is None:
        args.seconds = 2.5 if args.quick else 8.0
    args.rates = [int(r) for r in args.rates.split(",")] if args.rates else [100, 500, 1000, 2000]
    args.ramp = (
        [] if args.no_ramp else
        [2500, 3000, 3500, 4000, 5000] if args.quick else
        [2500, 3000, 3500, 4000, 4500, 5000, 6000, 7000, 8000]
    )  # fmt: skip
    args.peer = [p.strip() for p in args.peer.split(",") if p.strip()] if args.peer else []
    unknown = [p for p in args.peer if p not in gateway_peers.KINDS]
    if unknown:
        parser.error(f"--peer: unknown {unknown}; known: {', '.join(gateway_peers.KINDS)}")
    if args.peer and args.workers:
        parser.error("--peer measures one gateway process: not with --workers")
    if args.nice:
        os.nice(args.nice)  # inherited by the upstream and gateway processes
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    gateway_cpus = others = None
    if args.pin and len(cpus) >= 2:
        gateway_cpus, others = {cpus[-1]}, set(cpus[:-1])
    else:
        args.pin = False
    counts = [int(n) for n in args.workers.split(",")] if args.workers else [1]
    if max(counts) > 1:
        args.pin = False  # workers take every core
        gateway_cpus = others = None
    upstream, upstream_port = _spawn(
        "upstream", *(["--stream"] if args.stream else []), cpus=others
    )
    gateway_peers.pin(others)
    results: dict[int, dict[str, Any]] = {}
    try:
        for count in counts:
            gateway, gateway_port = _spawn(
                "gateway", "--upstream-url", f"http://127.0.0.1:{upstream_port}",
                "--gateway-workers", str(count), cpus=gateway_cpus,
                ready_lines=count if count > 1 else 0,
            )
            try:
                print(
                    f"upstream :{upstream_port}  gateway :{gateway_port} ({count} worker"
                    f"{'s' if count > 1 else ''})  pinned: "
                    f"{'gateway on cpu ' + str(gateway_cpus) if args.pin else 'no'}",
                    flush=True,
                )
                results[count] = uvloop.run(
                    _measure(args, upstream_port, gateway_port, gateway.pid))
            finally:
                _stop(gateway)
        peers = _measure_peers(args, upstream_port, gateway_cpus) if args.peer else {}
    finally:
        _stop(upstream)
    if not args.workers:
        result = results[1]
        if args.peer:
            result.update(compare(result, peers))
        print(json.dumps(result))
        return
    held = {str(n): r["max_rps_p99_under_50ms"] for n, r in results.items()}
    first = results[counts[0]]["max_rps_p99_under_50ms"]
    print(json.dumps({
        "max_rps_p99_under_50ms": held,
        # Rate held with the most workers over the rate held with the fewest.
        "scaling": round(results[counts[-1]]["max_rps_p99_under_50ms"] / first, 2)
        if first else None,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "workers": {str(n): r for n, r in results.items()},
    }))


def _measure_peers(
    args: argparse.Namespace, upstream_port: int, gateway_cpus: set[int] | None
) -> dict[str, dict[str, Any]]:
    """Each of ``--peer``'s routers measured as the gateway was (no ramp), or why it was not."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # One core, as llmgw's one process: the gateway's when pinned, else the last.
    peer_cpus = gateway_cpus or ({cpus[-1]} if cpus else None)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    measured: dict[str, dict[str, Any]] = {}
    for name in args.peer:
        kind = gateway_peers.KINDS[name]
        python = gateway_peers.find_python(kind)
        if python is None and not args.no_install:
            why = gateway_peers.install()
            python = gateway_peers.find_python(kind) if why is None else None
        if python is None:
            why = f"{name} is not installed (scripts/bench-peers.sh installs it)"
            print(f"--peer: {name} skipped: {why}", flush=True)
            measured[name] = {"skipped": why}
            continue
        try:
            probe = LoadGenerator(upstream_port, auth=False, stream=args.stream).request
            peer = gateway_peers.start(kind, python, upstream_url, peer_cpus, probe)
        except RuntimeError as exc:
            print(f"--peer: {name} skipped: {exc}", flush=True)
            measured[name] = {"skipped": str(exc)}
            continue
        try:
            print(f"{name} :{peer.port} (round robin, no keys) on cpu {peer_cpus}", flush=True)
            measured[name] = uvloop.run(
                _measure(args, upstream_port, peer.port, peer.process.pid, ramp=False))
        finally:
            gateway_peers.stop(peer)
    return measured


def compare(llmgw: dict[str, Any], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per system and rate the CPU per request and added latency; llmgw's CPU over the best peer's.

    ``cpu_ratio_to_best_peer_at_<rate>``: llmgw's CPU per request over the
    lowest of the peers' at that rate (at or below 1: no peer spends less);
    None where no peer was measured at it.
    """
    figures = ("cpu_ms_per_request", "added_p50_ms", "added_p99_ms", "errors", "achieved_rps")
    systems: dict[str, Any] = {}
    for name, result in {"llmgw": llmgw, **peers}.items():
        if "skipped" in result:
            systems[name] = {"skipped": result["skipped"]}
            continue
        systems[name] = {
            str(row["rate"]): {figure: row[figure] for figure in figures}
            for row in result["rows"]
        }
    out: dict[str, Any] = {"systems": systems, "peer_results": peers}
    for rate in ("1000", "2000"):
        mine = systems["llmgw"].get(rate, {}).get("cpu_ms_per_request")
        theirs = [
            system[rate]["cpu_ms_per_request"]
            for name, system in systems.items()
            if name != "llmgw" and rate in system
        ]
        out[f"cpu_ratio_to_best_peer_at_{rate}"] = (
            round(mine / min(theirs), 3) if mine is not None and theirs and min(theirs) else None
        )
    return out


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


if __name__ == "__main__":
    main()
