"""The benchmark's child processes: started in sessions of their own, read for URLs, stopped.

Each child runs in a session of its own (``start_new_session``), so that a
Ctrl-C meant for the benchmark does not reach it before the benchmark has
measured, and so that stopping it reaches whatever it started in turn.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from llmgw.wire import SimParams

READY_TIMEOUT_S = 60.0
# What each child prints, one line per server, once that server accepts:
# the URL is the line's last word.
ENGINE_MARKER = "listening on"
GATEWAY_MARKER = "gateway listening on"


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    """``argv`` in a session of its own, its stdout piped (for read_urls), its stderr ours."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                            start_new_session=True)  # fmt: skip


def read_urls(proc: subprocess.Popen[str], marker: str, count: int) -> list[str]:
    """The URLs of the first ``count`` lines of ``proc``'s stdout that hold ``marker``.

    Raises when the child exits first or READY_TIMEOUT_S passes: a benchmark
    that went on with fewer servers would measure another fleet.
    """
    urls: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    if proc.stdout is None:
        raise RuntimeError("child started without a stdout pipe")
    while len(urls) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{marker!r}: only {len(urls)} of {count} came up")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited ({proc.poll()}) before announcing {marker!r}")
        if marker in line:
            urls.append(line.strip().rsplit(" ", 1)[-1])
    return urls


def start_sim_engines(
    model: str, params: SimParams, count: int, port: int = 0
) -> tuple[subprocess.Popen[str], list[str]]:
    """``count`` simulated engines serving ``model`` in one child: (the process, their URLs).

    ``port``: the first engine's port, the others' follow it (0: any free ones).
    """
    proc = spawn([
        sys.executable, "-m", "llmgw.sim.engine", "--model", model, "--count", str(count),
        "--port", str(port), "--params-json", params.model_dump_json(),
    ])  # fmt: skip
    return proc, read_urls(proc, ENGINE_MARKER, count)


def stop(procs: list[subprocess.Popen[Any]]) -> None:
    """SIGTERM to each child's session, then SIGKILL to any that has not gone within 5 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
