"""Python opcodes the gateway's process runs per request: a deterministic measure of its CPU.

CPU time per request (bench/gateway.py) moves by 10-20 % between runs on a
shared machine; the number of interpreter steps does not. The same three
processes as bench/gateway.py (its upstream, the real gateway under
`llmgw gateway`'s server settings, a client here), but the client sends one
request at a time and the gateway's process counts, with
``sys.settrace`` and ``frame.f_trace_opcodes``, every opcode each function
runs while ``--requests`` requests are served after ``--warmup`` others.
Frames of uvicorn's once-a-tick main loop are not counted, and the
gateway's background loops (load reports, usage flushes) are set to run
once an hour: what is left is the requests' own work. C code (httptools,
orjson, uvloop, the kernel) runs no opcodes: this counts only the Python
part of the cost, the part llmgw's code decides.

    python bench/gateway_opcount.py [--stream] [--requests 300] [--headers 14] [--top 30]

``--headers 14``: the request carries the 14 headers the official openai
client sends (default: the 4 of bench/gateway.py's load). Also counted:
Python frames started per request (a call costs more than its opcodes say)
and young-generation garbage collections per request. Last line: JSON with
opcodes_per_request, frames_per_request, gc_gen0_per_request and the top
functions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/gateway.py: the upstream, the config, the bodies.
import gateway as bench

# What the official openai client (openai-python over httpx) sends besides
# the body's own: 14 headers with Host and Content-Length.
OPENAI_HEADERS = [
    b"Host: 127.0.0.1",
    b"Accept-Encoding: gzip, deflate",
    b"Connection: keep-alive",
    b"Accept: application/json",
    b"Content-Type: application/json",
    b"User-Agent: OpenAI/Python 1.54.4",
    b"X-Stainless-Lang: python",
    b"X-Stainless-Package-Version: 1.54.4",
    b"X-Stainless-OS: Linux",
    b"X-Stainless-Arch: x64",
    b"X-Stainless-Runtime: CPython",
    b"X-Stainless-Runtime-Version: 3.11.9",
    b"X-Stainless-Async: async:asyncio",
    b"X-Stainless-Retry-Count: 0",
]

# Frames not counted, nor anything they call: uvicorn's tick (the date
# header, ten times a second) belongs to no request.
_SKIPPED = {("server.py", "main_loop"), ("server.py", "on_tick"), ("server.py", "serve"),
            ("server.py", "_serve"), ("gateway_opcount.py", "_command")}  # fmt: skip


def _request(stream: bool, openai_headers: bool) -> bytes:
    body = bench.STREAM_REQUEST_BODY if stream else bench.REQUEST_BODY
    if openai_headers:
        lines = [b"POST /v1/chat/completions HTTP/1.1", *OPENAI_HEADERS]
    else:
        lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: 127.0.0.1",
                 b"Content-Type: application/json"]  # fmt: skip
    lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Authorization: Bearer " + bench.KEY.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# ---------------------------------------------------------------------------
# The gateway's process
# ---------------------------------------------------------------------------


class _Counter:
    """Opcodes per code object, for frames started while counting."""

    def __init__(self, lines_of: set[str]) -> None:
        self.counts: Counter[CodeType] = Counter()
        # Frames started (a call, or a coroutine resumed), per code object.
        self.calls: Counter[CodeType] = Counter()
        # Per line, for the functions named in --lines.
        self.lines: Counter[tuple[CodeType, int]] = Counter()
        self._lines_of = lines_of
        self._skipped: dict[CodeType, bool] = {}

    def _skip(self, frame: FrameType) -> bool:
        at: FrameType | None = frame
        while at is not None:
            code = at.f_code
            skip = self._skipped.get(code)
            if skip is None:
                skip = (Path(code.co_filename).name, code.co_name) in _SKIPPED
                self._skipped[code] = skip
            if skip:
                return True
            at = at.f_back
        return False

    def call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or self._skip(frame):
            return None
        self.calls[frame.f_code] += 1
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self.step_lines if frame.f_code.co_qualname in self._lines_of else self.step

    def step(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.counts[frame.f_code] += 1
        return self.step

    def step_lines(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.counts[frame.f_code] += 1
            self.lines[(frame.f_code, frame.f_lineno)] += 1
        return self.step_lines


async def _serve_gateway(upstream_url: str, lines_of: set[str]) -> None:
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
    from llmgw.gateway.settings import GatewaySettings
    from llmgw.serving import start_server

    config = bench.gateway_config(upstream_url)
    # Background work once an hour: not inside the counted window.
    settings = GatewaySettings(load_report_s=3600.0, usage_flush_s=3600.0)
    gateway = Gateway(MemoryLink(config, poll_timeout_s=3600), settings)
    await gateway.start()
    await gateway.wait_configured(10)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    served = server_config(gateway, log_level="warning", backlog=128)
    served.load()
    freeze_startup_objects()
    server = uvicorn.Server(served)
    await start_server(server, [sock])
    counter = _Counter(lines_of)
    young_before = 0
    loop = asyncio.get_running_loop()

    def _command() -> None:
        nonlocal young_before
        line = sys.stdin.readline().strip()
        if line == "start":
            young_before = gc.get_stats()[0]["collections"]
            sys.settrace(counter.call)
        elif line == "stop":
            sys.settrace(None)
            young = gc.get_stats()[0]["collections"] - young_before
            counts = [
                [f"{Path(code.co_filename).name}:{code.co_firstlineno}:{code.co_qualname}", n,
                 counter.calls[code]]
                for code, n in counter.counts.most_common()
            ]
            lines = [
                [f"{Path(code.co_filename).name}:{line}:{code.co_qualname}", n]
                for (code, line), n in sorted(counter.lines.items(), key=lambda kv: kv[0][1] or 0)
            ]
            print(json.dumps({"counts": counts, "lines": lines, "gc_gen0": young}), flush=True)
        elif line == "" or line == "exit":
            loop.stop()

    loop.add_reader(sys.stdin.fileno(), _command)
    print(sock.getsockname()[1], flush=True)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------
# The client (this process)
# ---------------------------------------------------------------------------


def _read_answer(sock: socket.socket, buffer: bytes) -> bytes:
    """Read one whole answer; what was read past it is returned."""
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    end = buffer.index(b"\r\n\r\n")
    head = buffer[:end].lower()
    if not head.startswith(b"http/1.1 200"):
        raise SystemExit(f"the gateway answered: {buffer[:300]!r}")
    rest = buffer[end + 4 :]
    if b"transfer-encoding: chunked" in head:
        while not rest.endswith(b"0\r\n\r\n"):
            rest += sock.recv(65536)
        return b""
    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return rest[length:]


def _send(port: int, request: bytes, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        for _ in range(count):
            sock.sendall(request)
            buffer = _read_answer(sock, buffer)


def _spawn(args: list[str], stdin: bool = False) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, text=True,
        stdin=subprocess.PIPE if stdin else None,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.strip():
        process.kill()
        raise SystemExit(f"{args[0]} did not start")
    return process, int(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="streamed chat with include_usage")
    parser.add_argument("--requests", type=int, default=300, help="requests counted")
    parser.add_argument("--warmup", type=int, default=200, help="requests before counting")
    parser.add_argument(
        "--headers",
        type=int,
        choices=(4, 14),
        default=4,
        help="request headers: bench/gateway.py's 4, or the openai client's 14",
    )
    parser.add_argument("--top", type=int, default=30, help="functions listed")
    parser.add_argument(
        "--lines", default="", help="comma-separated qualified names: their opcodes per line"
    )
    parser.add_argument(
        "--quick", action="store_true", help="100 requests after 100 (make bench-quick)"
    )
    parser.add_argument("--role", choices=["gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--upstream-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warmup = 100, 100
    if args.role == "gateway":
        import uvloop

        uvloop.run(_serve_gateway(args.upstream_url, set(filter(None, args.lines.split(",")))))
        return
    gateway_py = str(Path(bench.__file__))
    upstream, upstream_port = _spawn(
        [gateway_py, "--role", "upstream", *(["--stream"] if args.stream else [])]
    )
    gateway, port = _spawn(
        [
            __file__,
            "--role",
            "gateway",
            "--upstream-url",
            f"http://127.0.0.1:{upstream_port}",
            "--lines",
            args.lines,
        ],
        stdin=True,
    )
    assert gateway.stdin is not None and gateway.stdout is not None
    try:
        request = _request(args.stream, args.headers == 14)
        _send(port, request, args.warmup)
        time.sleep(0.2)
        gateway.stdin.write("start\n")
        gateway.stdin.flush()
        time.sleep(0.2)
        _send(port, request, args.requests)
        time.sleep(0.2)  # the last answer's after-work (done callbacks) is counted too
        gateway.stdin.write("stop\n")
        gateway.stdin.flush()
        result = json.loads(gateway.stdout.readline())
    finally:
        for process in (gateway, upstream):
            process.terminate()
        for process in (gateway, upstream):
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
    n = args.requests
    counts: list[tuple[str, int]] = [(name, count) for name, count, _ in result["counts"]]
    total = sum(count for _, count in counts)
    # Frames started: a Python call (or a coroutine's resumption) costs more
    # than its opcodes say (a frame to set up and tear down).
    frames = sum(started for _, _, started in result["counts"])
    print(f"{'opcodes/req':>11}  {'frames/req':>10}  function")
    for name, count, started in result["counts"][: args.top]:
        print(f"{count / n:11.1f}  {started / n:10.2f}  {name}")
    kind = "streamed" if args.stream else "plain"
    print(f"{total / n:11.1f}  {frames / n:10.1f}  TOTAL ({n} requests, {kind},"
          f" {args.headers} request headers)")  # fmt: skip
    print(f"young-generation collections per request: {result['gc_gen0'] / n:.4f}")
    for name, count in result["lines"]:
        print(f"{count / n:11.1f}  line {name}")
    print(json.dumps({
        "opcodes_per_request": round(total / n, 1),
        "frames_per_request": round(frames / n, 1),
        "gc_gen0_per_request": round(result["gc_gen0"] / n, 4),
        "stream": args.stream,
        "request_headers": args.headers,
        "requests": n,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "top": [[name, round(count / n, 1)] for name, count in counts[:30]],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
