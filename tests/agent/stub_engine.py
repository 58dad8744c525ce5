"""A stand-in engine for agent tests: a tiny HTTP server that starts in milliseconds.

It answers ``/health`` (503 until ``--ready-after`` seconds have passed, then
200) and ``/v1/models``, prints a few log lines, and can misbehave on
request: exit with a code after a while, ignore SIGTERM, or stop answering
``/health`` (hold the request unanswered) from ``--health-stall-after``
seconds after its start, for ``--health-stall-for`` seconds or for good.
``--grow-mib`` makes it take that much more memory (touched, so resident)
``--grow-after`` seconds after its start, ``--grow-step-mib`` at a time, as a
leaking engine does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub")
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--health-stall-after", type=float, default=None)
    parser.add_argument("--health-stall-for", type=float, default=None)
    parser.add_argument("--grow-mib", type=int, default=0)
    parser.add_argument("--grow-step-mib", type=int, default=8)
    parser.add_argument("--grow-after", type=float, default=0.0)
    parser.add_argument("--try-read", action="append", default=[],
                        help="say in the log whether this file can be read")
    args = parser.parse_args()
    started = time.monotonic()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"stub engine {args.model} pid {os.getpid()} on {args.host}:{args.port}", flush=True)
    print(f"env CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)
    print(f"uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}"
          f" home {os.environ.get('HOME')}", flush=True)
    for path in args.try_read:
        try:
            with open(path, "rb") as handle:
                handle.read(1)
            print(f"read {path}: ok", flush=True)
        except OSError as exc:
            print(f"read {path}: {type(exc).__name__}", flush=True)

    def stall_left() -> float:
        if args.health_stall_after is None:
            return 0.0
        into = time.monotonic() - started - args.health_stall_after
        if into < 0:
            return 0.0
        if args.health_stall_for is None:
            return 3600.0
        return max(0.0, args.health_stall_for - into)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = time.monotonic() - started >= args.ready_after
            if self.path == "/health":
                stall_s = stall_left()
                if stall_s > 0:
                    time.sleep(stall_s)  # this request's thread only: /v1/models still answers
                self._send(200 if ready else 503, {"ready": ready})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model}]})
            else:
                self._send(404, {"error": "not found"})

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *a: object) -> None:
            return

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if args.exit_after is not None:

        def leave() -> None:
            time.sleep(args.exit_after)
            print(f"stub engine fatal: giving up with code {args.exit_code}", flush=True)
            os._exit(args.exit_code)

        threading.Thread(target=leave, daemon=True).start()
    if args.grow_mib:
        held: list[bytearray] = []

        def grow() -> None:
            time.sleep(args.grow_after)
            grown = 0
            while grown < args.grow_mib:
                step = min(args.grow_step_mib, args.grow_mib - grown)
                held.append(bytearray(b"x" * (step << 20)))  # written: resident, not lazy
                grown += step
                time.sleep(0.02)
            print(f"stub engine grew by {grown} MiB", flush=True)

        threading.Thread(target=grow, daemon=True).start()
    print("stub engine ready to serve", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
