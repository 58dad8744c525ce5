"""One port served by several processes: the parent binds and supervises, its workers serve.

The parent binds one listening socket per worker on the same address with
``SO_REUSEPORT`` and hands each worker its own (an inherited descriptor);
the kernel spreads new connections over the sockets by a hash of the
client's address and port. Nothing passes through the parent per request or
per connection: it only watches its workers.

Why ``SO_REUSEPORT`` rather than one socket shared by all: with one shared
socket, whichever worker wakes first accepts every connection waiting, so a
client opening its pool of keep-alive connections at once often lands them
all on one worker (and one core). Per-worker sockets spread them evenly.

The parent:

* checks the port is free before binding the group (every socket of a
  ``SO_REUSEPORT`` group sets the option; llmgw's probe does not, so a second
  llmgw on a taken port fails as before instead of joining the group);
* restarts a worker that dies (at once if it ran for a while, with a growing
  delay if it keeps dying at start); the dead worker's socket is closed and a
  fresh one bound for its successor, so meanwhile new connections go to the
  live workers (connections the dead one had not accepted yet are reset);
* stops every worker on SIGTERM or SIGINT (SIGTERM each, then SIGKILL after
  a grace period) and exits once they are gone;
* holds the write end of a pipe every worker reads: a parent that dies
  without stopping them (SIGKILL) closes it, and each worker stops on its
  end-of-file, so no worker outlives its parent;
* passes SIGUSR1 (llmgw.procstats' request for figures) on to every worker;
* stops the whole pool with exit status 2 when a worker exits 2 (a
  configuration the worker refused, such as a gateway token the control
  plane does not know: its successors would refuse it too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.errors import ConfigError

log = logging.getLogger("llmgw.workers")

# The exit status of a process that refused its configuration.
CONFIG_EXIT = 2
# A worker that ran at least this long is restarted at once; one that died
# sooner waits a delay doubling from RESTART_DELAY_S to MAX_RESTART_DELAY_S,
# so a worker that cannot start does not spin the machine.
STEADY_AFTER_S = 10.0
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 10.0
# How long workers have to finish their requests and flush usage on a stop.
STOP_GRACE_S = 15.0
_BACKLOG = 2048

# The command of worker ``index``: its argv, given its listening descriptor
# and the lifeline's read end.
WorkerCommand = Callable[[int, int, int], Sequence[str]]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError when ``host:port`` is taken (by anyone, llmgw's workers included)."""
    if port == 0:
        return
    probe = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    finally:
        probe.close()


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` in a ``SO_REUSEPORT`` group."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("--workers needs SO_REUSEPORT (Linux, BSD, macOS)")
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@dataclass
class Worker:
    index: int
    sock: socket.socket
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    delay_s: float = 0.0  # before the next restart, if it dies young
    due_at: float = 0.0  # when a restart waiting its delay is due
    restarts: int = 0


@dataclass
class WorkerPool:
    """``count`` workers serving ``host:port``; ``command`` builds each one's argv."""

    host: str
    port: int
    count: int
    command: WorkerCommand
    env: Mapping[str, str] | None = None
    stop_grace_s: float = STOP_GRACE_S
    workers: list[Worker] = field(default_factory=list)
    stopping: bool = False
    exit_status: int = 0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.count}")
        self._lifeline_read, self._lifeline_write = os.pipe()

    def start(self) -> None:
        """Bind the group and start every worker."""
        check_port_free(self.host, self.port)
        first = reuseport_socket(self.host, self.port)
        # With port 0 the kernel picked one; the others join it there.
        self.port = first.getsockname()[1]
        socks = [first]
        try:
            socks += [reuseport_socket(self.host, self.port) for _ in range(self.count - 1)]
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        self.workers = [Worker(index, sock) for index, sock in enumerate(socks)]
        log.info("%d workers on %s:%s (SO_REUSEPORT), supervised by pid %d", self.count,
                 self.host, self.port, os.getpid())
        for worker in self.workers:
            self._spawn(worker)

    def _spawn(self, worker: Worker) -> None:
        fd = worker.sock.fileno()
        argv = list(self.command(worker.index, fd, self._lifeline_read))
        worker.process = subprocess.Popen(
            argv, pass_fds=(fd, self._lifeline_read),
            env=dict(self.env) if self.env is not None else None,
        )
        worker.started_at = time.monotonic()
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None]

    def check(self) -> bool:
        """Restart dead workers whose delay is over; False once the pool must stop."""
        now = time.monotonic()
        for worker in self.workers:
            process = worker.process
            if process is not None:
                status = process.poll()
                if status is None:
                    continue
                self._died(worker, status, now)
                if self.stopping:
                    return False
            if worker.process is None and now >= worker.due_at:
                worker.restarts += 1
                self._spawn(worker)
        return not self.stopping

    def _died(self, worker: Worker, status: int, now: float) -> None:
        worker.process = None
        if status == CONFIG_EXIT:
            log.error("worker %d refused its configuration (exit %d): stopping every worker",
                      worker.index, status)
            self.exit_status = CONFIG_EXIT
            self.stopping = True
            return
        lived = now - worker.started_at
        worker.delay_s = 0.0 if lived >= STEADY_AFTER_S else min(
            MAX_RESTART_DELAY_S, max(RESTART_DELAY_S, 2 * worker.delay_s))
        worker.due_at = now + worker.delay_s
        log.warning("worker %d exited (status %s after %.1f s); restarting it in %.1f s",
                    worker.index, status, lived, worker.delay_s)
        # New connections go to the live workers meanwhile: a socket no one
        # accepts on would hold them until the successor starts.
        try:
            fresh = reuseport_socket(self.host, self.port)
        except ConfigError as exc:
            log.warning("worker %d keeps its socket (%s)", worker.index, exc)
            return
        worker.sock.close()
        worker.sock = fresh

    def stop(self) -> None:
        """SIGTERM every worker, SIGKILL those left after the grace period; close the port."""
        self.stopping = True
        running = [w.process for w in self.workers if w.process is not None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d still running after %.0f s: killing it",
                            process.pid, self.stop_grace_s)
                process.kill()
                process.wait()
        for worker in self.workers:
            worker.process = None
            worker.sock.close()
        for fd in (self._lifeline_read, self._lifeline_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def run(self, poll_s: float = 0.2, started: Callable[[WorkerPool], None] | None = None) -> int:
        """Start, supervise until SIGTERM/SIGINT (or a refused configuration), stop; the status.

        ``started`` is called once the port is bound and the workers started.
        """
        stop_asked = False

        def ask_stop(signum: int, _frame: object) -> None:
            nonlocal stop_asked
            stop_asked = True

        def forward(signum: int, _frame: object) -> None:
            # SIGUSR1 asks a process for its figures (llmgw.procstats): each
            # worker answers for itself, rather than this parent dying of it.
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

        previous = {sig: signal.signal(sig, ask_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, forward)
        try:
            self.start()
            if started is not None:
                started(self)
            while not stop_asked and self.check():
                time.sleep(poll_s)
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.exit_status


def watch_lifeline(fd: int, on_parent_gone: Callable[[], None]) -> None:
    """In a worker: call ``on_parent_gone`` once the parent's end of the lifeline closes."""
    import asyncio

    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            return
        if not data:  # end of file: no process holds the write end any more
            loop.remove_reader(fd)
            on_parent_gone()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
