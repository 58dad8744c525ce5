"""Processes of the fleet under test: start, signal, find their engines, stop.

Each llmgw program runs in a session of its own (``start_new_session``) so a
signal meant for it never reaches this process, and so that closing the
fleet can reach whatever it left behind. Engines are not in their agent's
session (the supervisor starts each in its own, so that they outlive an
agent), so they are found as the agent's children while it lives, and by
the port on their command line (the replica's, from the admin API).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """SIGTERM when the suite dies without closing the fleet (killed by a timeout, say).

    Agents run with --stop-engines, so theirs go too. Set in the child, where
    it applies to the thread that started it: the suite starts every process
    from its event loop's thread, which lives as long as it does.
    """
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Proc:
    """One llmgw program: its command line, its log, and the running process if any."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    stopped: bool = False  # SIGSTOP sent and no SIGCONT yet

    def start(self) -> None:
        env = {**os.environ, **self.env}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                [*LLMGW, *self.argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
            self.stopped = sig == signal.SIGSTOP

    def kill9(self) -> None:
        """kill -9 of the program itself (its engines, in sessions of their own, live on)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait(10)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to its session, then SIGKILL if it does not go."""
        if self.popen is None or self.popen.poll() is not None:
            return
        if self.stopped:
            self.signal(signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(10)

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def is_engine(argv: list[str]) -> bool:
    return "llama_cpp.server" in argv or "llmgw.sim.engine" in argv


def engine_children(pid: int) -> list[psutil.Process]:
    """Engines a running agent started (its children until it dies)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if is_engine(child.cmdline()):
                out.append(child)
    return out


def engine_on_port(port: int) -> psutil.Process | None:
    """The engine process listening on ``port`` (its argv says ``--port N``)."""
    wanted = str(port)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "--port" in argv and argv.index("--port") + 1 < len(argv) and (
            argv[argv.index("--port") + 1] == wanted
        ) and is_engine(argv):
            return proc
    return None


def connections_in(proc: psutil.Process, port: int) -> int:
    """Open connections to ``proc`` on ``port``: an engine's requests in flight, at most.

    The gateway keeps idle connections to an engine open between requests,
    so this counts those too; a connection carries one request at a time,
    so the engine cannot hold more.
    """
    try:
        conns = proc.net_connections(kind="tcp")
    except psutil.Error:
        return 0
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr
               and c.laddr.port == port)


def orphan_engines(root: Path) -> list[psutil.Process]:
    """Engines left by agents killed during the run: their logs are under ``root``."""
    marker = str(root)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if not is_engine(argv):
            continue
        with contextlib.suppress(psutil.Error):
            if any(marker in f.path for f in proc.open_files()) or marker in " ".join(argv):
                found.append(proc)
    return found


def kill_all(procs: list[psutil.Process], sig: int = signal.SIGKILL) -> list[int]:
    killed = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            killed.append(proc.pid)
    return killed


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_running(pid) for pid in pids):
            return
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
