"""Engine processes: start, watch, stop, and their logs.

This is the only module of the agent that creates processes or sends
signals, so the rest of the agent can be tested with a fake.

- Each engine runs in its own session (``start_new_session``): a Ctrl-C in the
  agent's terminal does not reach it, an agent that dies does not take it
  along (adoption), and a stop signals the whole group, so the workers an
  engine forks (vLLM's per-GPU processes) go with it.
- stdout and stderr go straight to a file the engine itself holds open in
  append mode, never through a pipe to the agent: a pipe would kill the
  engine with SIGPIPE when the agent goes away. Rotation is copy-then-truncate
  (logrotate's ``copytruncate``); append mode makes the engine's next write
  land at the new end of the file instead of leaving a hole.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from llmgw.agent.engines.base import EngineLaunch, SecretFile
from llmgw.agent.engineuser import EngineUser
from llmgw.errors import EngineError

LOG_MAX_BYTES = 8 * 1024 * 1024
LOG_BACKUPS = 2
TAIL_LINES = 20
TAIL_LINE_CHARS = 400
# Names the replica in each engine's environment, with the agent's logs
# folder: two agents on one host (a test machine, nodes in network
# namespaces) may both run a replica of one id, and neither may take the
# other's. The agent records an engine's pid only once the spawn returns; an
# agent killed in between would otherwise leave an engine nobody knows of
# holding its GPUs for good.
REPLICA_ENV = "LLMGW_ENGINE_REPLICA"


@dataclass
class EngineProcess:
    pid: int
    birth: str  # see process_birth: with the pid, names this very process
    popen: subprocess.Popen[bytes] | None = None  # None for an adopted engine
    # What a non-process ProcessControl (e.g. a simulated fleet running its
    # engines inside one Python process) needs to find its engine again.
    handle: Any = None


@dataclass(frozen=True)
class ExitStatus:
    exited: bool
    code: int | None = None  # negative: killed by that signal; None: unknown


RUNNING = ExitStatus(exited=False)


class ProcessControl(Protocol):
    """What the agent needs from whatever runs its engines (the seam for fakes)."""

    def spawn(self, replica_id: str, launch: EngineLaunch) -> EngineProcess: ...

    def adopt(self, pid: int, birth: str) -> EngineProcess | None: ...

    def find(self, replica_id: str) -> EngineProcess | None: ...

    def poll(self, proc: EngineProcess) -> ExitStatus: ...

    async def stop(self, proc: EngineProcess, grace_s: float) -> ExitStatus: ...

    def log_tail(
        self, replica_id: str, lines: int = ..., secret: str | None = None
    ) -> list[str]: ...

    def rotate_if_large(self, replica_id: str) -> None: ...


def describe_exit(code: int | None) -> str:
    if code is None:
        return "engine exited (exit code unknown: it ended while the agent was away)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine killed by {name}"
    return f"engine exited with code {code}"


def engine_environment(added: dict[str, str], drop: frozenset[str] = frozenset()) -> dict[str, str]:
    """The agent's environment without its own secrets, plus the launch's variables.

    ``drop``: upper-case names the engine would read as settings over its
    command line (``EngineLaunch.drop_env``), removed in any case.
    """
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("LLMGW_") and k.upper() not in drop
    }
    # Python engines buffer stdout when it is a file; unbuffered, the last
    # lines before a crash reach the log and the failure reason.
    env["PYTHONUNBUFFERED"] = "1"
    env.update(added)
    return env


@dataclass(eq=False)
class Supervisor:
    logs_dir: Path
    _: KW_ONLY
    log_max_bytes: int = LOG_MAX_BYTES
    log_backups: int = LOG_BACKUPS
    # Engines run under this user (agent.engineuser); None: the agent's own.
    engine_user: EngineUser | None = None

    def log_path(self, replica_id: str) -> Path:
        return self.logs_dir / f"{replica_id}.log"

    def spawn(self, replica_id: str, launch: EngineLaunch) -> EngineProcess:
        if not launch.argv:
            raise EngineError("empty engine command")
        argv = self.command(replica_id, launch)
        path = self.log_path(replica_id)
        self._shift_logs(path)
        env = engine_environment(launch.env, launch.drop_env)
        env[REPLICA_ENV] = self._mark(replica_id)
        user: dict[str, Any] = {}
        if self.engine_user is not None:
            env |= self.engine_user.env()
            if launch.guarded:
                # The guard keeps the agent's user (it holds the node's TLS
                # key) and starts the engine under the engine user.
                end = argv.index("--")
                argv[end:end] = ["--engine-user", self.engine_user.name]
            else:
                user = self.engine_user.popen()
        # Owner-only: the engine writes to it through the descriptor it is given.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "ab") as log_file:
            try:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **user,
                )
            except FileNotFoundError:
                raise EngineError(
                    f"{launch.argv[0]} not found: is this engine installed on the node?"
                ) from None
            except OSError as exc:
                raise EngineError(f"cannot start {launch.argv[0]}: {exc}") from None
        # None: already gone, and poll() says so from the Popen.
        birth = process_birth(popen.pid) or ""
        return EngineProcess(pid=popen.pid, birth=birth, popen=popen)

    def command(self, replica_id: str, launch: EngineLaunch) -> list[str]:
        """The argv the engine is started with: the launch's, and its secret file's
        flag and path (the file written first)."""
        self.logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = list(launch.argv)
        if launch.secret_file is not None:
            secret = self._write_secret(replica_id, launch.secret_file)
            argv += [launch.secret_file.flag, str(secret)]
        return argv

    def _write_secret(self, replica_id: str, secret: SecretFile) -> Path:
        """The launch's secret in a file of its own, readable by the engine's user only
        (the agent's, unless engines run under a user of their own)."""
        path = self.logs_dir / f"{replica_id}.secret{secret.suffix}"
        path.unlink(missing_ok=True)  # a fresh file, created 0600 (never widened)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(secret.text)
        if self.engine_user is not None:
            self.engine_user.give(path)
        return path

    @staticmethod
    def adopt(pid: int, birth: str) -> EngineProcess | None:
        """The engine recorded as ``pid`` if that very process still runs, else None."""
        if not birth or process_birth(pid) != birth:
            return None  # gone, or the pid now belongs to another process
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return None
        if not alive:
            _reap(pid)
            return None
        return EngineProcess(pid=pid, birth=birth)

    def _mark(self, replica_id: str) -> str:
        return f"{replica_id} {self.logs_dir.resolve()}"

    def find(self, replica_id: str) -> EngineProcess | None:
        """The engine this agent started for ``replica_id`` whose pid was never recorded,
        if it runs.

        Only a session leader of this user counts: an engine's own workers
        inherit its environment, and the group is stopped through its leader.
        """
        mark = self._mark(replica_id)
        uid = os.getuid()
        for candidate in psutil.process_iter(["uids"]):
            try:
                uids = candidate.info["uids"]
                if uids is None or uids.real != uid or os.getsid(candidate.pid) != candidate.pid:
                    continue
                if candidate.environ().get(REPLICA_ENV) != mark:
                    continue
            except (psutil.Error, OSError):
                continue  # gone meanwhile, or not ours to read
            birth = process_birth(candidate.pid)
            if birth is not None:
                return EngineProcess(pid=candidate.pid, birth=birth)
        return None

    @staticmethod
    def poll(proc: EngineProcess) -> ExitStatus:
        if proc.popen is not None:
            code = proc.popen.poll()
            return RUNNING if code is None else ExitStatus(exited=True, code=code)
        if process_birth(proc.pid) != proc.birth:
            return ExitStatus(exited=True)
        try:
            if psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE:
                return ExitStatus(exited=True, code=_reap(proc.pid))
        except psutil.NoSuchProcess:
            return ExitStatus(exited=True)
        except psutil.Error:
            return RUNNING
        return RUNNING

    async def stop(self, proc: EngineProcess, grace_s: float) -> ExitStatus:
        """SIGTERM to the engine's group, SIGKILL after ``grace_s``; the exit status."""
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        status = self.poll(proc)
        while not status.exited and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            status = self.poll(proc)
        # Also after a clean exit of the leader: workers it forked into the
        # same group may still hold GPU memory.
        _signal_group(proc.pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 5.0
        while not status.exited and time.monotonic() < kill_deadline:
            await asyncio.sleep(0.05)
            status = self.poll(proc)
        return status

    def log_tail(
        self, replica_id: str, lines: int = TAIL_LINES, secret: str | None = None
    ) -> list[str]:
        """The log's last lines, each cut to TAIL_LINE_CHARS, with ``secret`` blanked
        (before the cut, which could leave part of it)."""
        path = self.log_path(replica_id)
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(0, size - 64 * 1024))
                data = handle.read()
        except OSError:
            return []
        text = data.decode("utf-8", errors="replace").replace("\r", "\n")
        if secret:
            text = text.replace(secret, "<engine key>")
        kept = [line[:TAIL_LINE_CHARS] for line in text.split("\n") if line.strip()]
        return kept[-lines:]

    def rotate_if_large(self, replica_id: str) -> None:
        path = self.log_path(replica_id)
        try:
            if path.stat().st_size <= self.log_max_bytes:
                return
            self._shift_backups(path)
            shutil.copyfile(path, path.with_name(path.name + ".1"))
            with open(path, "r+b") as handle:
                handle.truncate(0)
        except OSError:
            return  # a log we cannot rotate is not worth failing an engine for

    def _shift_logs(self, path: Path) -> None:
        if path.exists():
            self._shift_backups(path)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(path.name + ".1"))

    def _shift_backups(self, path: Path) -> None:
        for index in range(self.log_backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                with contextlib.suppress(OSError):
                    os.replace(older, path.with_name(f"{path.name}.{index + 1}"))


def process_birth(pid: int) -> str | None:
    """A name for process ``pid`` that no other process gets while the machine runs.

    A pid alone is reused; pid plus psutil's ``create_time`` is not enough
    either: that is the start tick plus the boot time, and Linux derives the
    boot time from the wall clock in whole seconds, so it moves by a second
    when NTP nudges the clock across a second boundary. The same engine then
    looks like a stranger, and an agent that adopted it would take it for
    exited and kill it. The start tick itself never changes; with the boot id
    it also survives a reboot that hands out the same pids again. None when
    the process does not exist.
    """
    if not _HAS_PROC:
        return _birth_from_psutil(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:  # no such process, or it ended while we read
        return None
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return f"{_boot_id()}:{int(fields[19])}"


_HAS_PROC = os.path.isdir("/proc/self")


def _birth_from_psutil(pid: int) -> str | None:
    """Where there is no /proc (not Linux): the wall-clock start time, to a second."""
    try:
        return f"ctime:{psutil.Process(pid).create_time():.0f}"
    except psutil.Error:
        return None


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "boot"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(pid: int) -> int | None:
    """Collect the exit code of a zombie that is our own child; None otherwise."""
    try:
        done, raw = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(raw)
