"""The Rust routers bench/gateway.py measures beside llmgw (``--peer``): found, installed, started.

vLLM's router (PyPI ``vllm-router``) and SGLang's (PyPI ``sglang-router``)
are each a Rust router in a Python package. They are run against the
benchmark's own upstream, round robin over its one endpoint, without API
keys (neither checks a client's key per request the way llmgw does), each
pinned to one core: tokio sizes its worker pool by the cores it may use,
and llmgw's gateway is one Python process, which uses one core at most.

Where they come from: a Python that imports the router's package, first the
one running the benchmark (``pip install 'llmgw[bench]'`` puts both there),
then the benchmark's own virtualenv under ``~/.cache/llmgw/bench-peers``
(``LLMGW_BENCH_PEERS_DIR``), which ``scripts/bench-peers.sh`` makes with
pip. A peer that cannot be found or installed is reported as skipped, with
why: its figures are never made up.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/realkit/peers.py
PEERS_DIR = Path(
    os.environ.get("LLMGW_BENCH_PEERS_DIR", Path.home() / ".cache" / "llmgw" / "bench-peers")
)
INSTALL_SCRIPT = ROOT / "scripts" / "bench-peers.sh"


@dataclass(frozen=True)
class PeerKind:
    name: str  # as --peer names it (the PyPI package)
    module: str  # the module whose import says it is installed
    launcher: str  # the module run with -m
    log_level: str  # each spells "warning" its own way

    def argv(self, python: str, port: int, upstream_url: str, metrics_port: int) -> list[str]:
        return [
            python, "-m", self.launcher, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", upstream_url, "--policy", "round_robin",
            # Their metrics ports default to a fixed one: free ones, so runs never clash.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", self.log_level,
        ]  # fmt: skip


KINDS = {
    kind.name: kind
    for kind in (
        PeerKind("vllm-router", "vllm_router_rs", "vllm_router.launch_router", "warning"),
        PeerKind("sglang-router", "sglang_router", "sglang_router.launch_router", "warn"),
    )
}


def _imports(python: str, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_python(kind: PeerKind) -> str | None:
    """A Python that has ``kind``'s package: this one's, or the benchmark's own virtualenv's."""
    for python in (sys.executable, str(PEERS_DIR / "bin" / "python")):
        if Path(python).exists() and _imports(python, kind.module):
            return python
    return None


def install() -> str | None:
    """Install the peers into PEERS_DIR (scripts/bench-peers.sh); None, or why it failed."""
    print(f"--peer: installing vllm-router and sglang-router into {PEERS_DIR}"
          " (scripts/bench-peers.sh)", flush=True)  # fmt: skip
    try:
        done = subprocess.run(
            ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900,
            env={**os.environ, "LLMGW_BENCH_PEERS_DIR": str(PEERS_DIR)},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{INSTALL_SCRIPT.name} did not finish: {exc}"
    if done.returncode != 0:
        return f"{INSTALL_SCRIPT.name} failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Peer:
    kind: PeerKind
    process: subprocess.Popen[bytes]
    port: int
    log_path: str


def pin(cpus: set[int] | None) -> None:
    """Keep this process on ``cpus`` (None: anywhere; a no-op where affinity is unknown)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def pinner(cpus: set[int] | None) -> Callable[[], None]:
    """A child's ``preexec_fn`` that keeps it on ``cpus``."""
    return lambda: pin(cpus)


def start(
    kind: PeerKind, python: str, upstream_url: str, cpus: set[int] | None, probe: bytes
) -> Peer:
    """``kind`` in front of ``upstream_url``, on ``cpus`` (None: anywhere), once it answers
    ``probe`` (a whole request) with 200."""
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"bench-gateway-{kind.name}-{port}.log")

    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            kind.argv(python, port, upstream_url, free_port()), stdout=log,
            stderr=subprocess.STDOUT, preexec_fn=pinner(cpus), start_new_session=True,
        )  # fmt: skip
    peer = Peer(kind, process, port, log_path)
    try:
        _wait_serving(peer, probe, 90.0)
    except BaseException:
        stop(peer)
        raise
    return peer


def _wait_serving(peer: Peer, request: bytes, timeout_s: float) -> None:
    """Until ``peer`` answers ``request`` with 200 (it checks its worker first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if peer.process.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", peer.port), timeout=5) as sock:
                sock.sendall(request)
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    tail = re.sub(r"\x1b\[[0-9;]*m", "", Path(peer.log_path).read_text(errors="replace"))[-600:]
    raise RuntimeError(f"{peer.kind.name} did not serve within {timeout_s:.0f} s: {tail}")


def stop(peer: Peer) -> None:
    peer.process.terminate()
    try:
        peer.process.wait(10)
    except subprocess.TimeoutExpired:
        peer.process.kill()
        peer.process.wait()
