"""A replicated PostgreSQL store for tests: etcd and three members under Patroni, on loopback.

What the control plane must survive in production is a Patroni switchover or
the death of the database leader; canned ``/cluster`` answers cannot show
that the election, the pool and the fenced writes really follow the new
primary. This module runs the real thing (research/store-sched.md §1.2):
Debian's ``etcd`` as the DCS, ``patroni`` from the dev extra, the machine's
PostgreSQL binaries, every port picked free so nothing clashes with the
PostgreSQL on 5432.

PostgreSQL refuses to run as root, so under root the members run as the
``postgres`` user; a virtualenv whose interpreter lives under root's home is
not executable by that user, so Patroni then runs on the system interpreter
of the same version with this environment's site-packages on its path.

Replication is synchronous (``synchronous_mode``), which is what makes "an
acknowledged write survives the leader's death" true. Timings are cut to
the minimum Patroni accepts (ttl 20, loop_wait 1) so a test sees a failover
in seconds; the store is disposable, so durability
settings that cost time on 2 cores (fsync, full-page writes) are off. A
kill -9 of a postmaster loses nothing the OS already has, which is all a
test on one machine can kill.

Every process started here is stopped in ``close()`` (also on a failed
start), each postmaster by the pid in its own ``postmaster.pid``, and the
directory is removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from tests.servers import free_port
from tests.waiting import eventually_sync

SCOPE = "llmgw-test"
START_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Member:
    name: str
    pg_port: int
    api_port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class PatroniCluster:
    root: Path
    members: list[Member] = field(default_factory=list)
    etcd: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0
    _logs: list[Any] = field(default_factory=list)

    # -- what tests use ---------------------------------------------------------

    @property
    def api_urls(self) -> list[str]:
        return [m.api_url for m in self.members]

    def database_url(self, database: str = "llmgw") -> str:
        """The libpq multi-host form an operator gives ``llmgw serve``."""
        hosts = ",".join(f"127.0.0.1:{m.pg_port}" for m in self.members)
        return (f"postgresql://postgres@{hosts}/{database}"
                "?target_session_attrs=read-write&connect_timeout=2")

    def cluster(self) -> dict[str, Any]:
        """``GET /cluster`` from the first member that answers."""
        for url in self.api_urls:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = httpx.get(f"{url}/cluster", timeout=2)
                if answer.status_code == 200:
                    return dict(answer.json())
        return {"members": []}

    def leader(self) -> str | None:
        for member in self.cluster().get("members", []):
            if member.get("role") == "leader" and member.get("state") == "running":
                return str(member["name"])
        return None

    def sync_standby(self) -> str | None:
        """The member a switchover may go to, and the one a failover promotes."""
        for member in self.cluster().get("members", []):
            if member.get("role") == "sync_standby" and member.get("state") == "streaming":
                return str(member["name"])
        return None

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def healthy(self) -> bool:
        """A running leader, its synchronous standby and the third member, both streaming."""
        members = self.cluster().get("members", [])
        if len(members) != len(self.members):
            return False
        roles = sorted(str(m.get("role")) for m in members)
        return roles == ["leader", "replica", "sync_standby"] and all(
            m.get("state") in ("running", "streaming") for m in members)

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        eventually_sync(predicate, timeout_s, what, every_s=0.2,
                        note=lambda: f"/cluster: {self.cluster()}\n{self.log_tail()}")

    def switchover(self, candidate: str) -> None:
        """A planned switchover through the leader's REST API (what patronictl sends)."""
        leader = self.leader()
        assert leader, self.cluster()
        answer = httpx.post(f"{self.member(leader).api_url}/switchover",
                            json={"leader": leader, "candidate": candidate}, timeout=30)
        assert answer.status_code == 200, answer.text

    def kill_postmaster(self, name: str) -> int:
        """kill -9 of a member's postmaster (its Patroni stays and restarts it)."""
        pid = self.member(name).postmaster_pid()
        assert pid, f"{name} has no postmaster.pid"
        os.kill(pid, signal.SIGKILL)
        return pid

    def crash_member(self, name: str) -> None:
        """kill -9 of a member's Patroni and postmaster together: its machine died.

        Its leader key then expires (ttl) and another member is promoted.
        """
        member = self.member(name)
        pid = member.postmaster_pid()
        assert member.proc is not None
        _signal_group(member.proc, signal.SIGKILL)
        if pid is not None and _is_postmaster_of(pid, member.data_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def create_database(self, name: str) -> None:
        conninfo = (f"host={','.join('127.0.0.1' for _ in self.members)} "
                    f"port={','.join(str(m.pg_port) for m in self.members)} "
                    "user=postgres dbname=postgres target_session_attrs=read-write "
                    "connect_timeout=2")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # -- life cycle -----------------------------------------------------------

    def start(self) -> None:
        if shutil.which("etcd") is None:
            raise AssertionError("etcd is not installed: `make setup` installs Debian's "
                                 "etcd-server (apt-get install etcd-server)")
        account = _runner()
        self.etcd_port = free_port()
        peer_port = free_port()
        etcd_dir = self.root / "etcd"
        self.etcd = self._spawn("etcd", [
            "etcd", "--name", "e0", "--data-dir", str(etcd_dir),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"e0=http://127.0.0.1:{peer_port}",
            "--log-level", "warn",
        ], None)
        python, env = _patroni_python(account)
        bin_dir = _postgres_bin_dir()
        for index in range(3):
            member = Member(f"pg{index}", free_port(), free_port(), self.root / f"pg{index}")
            self.members.append(member)
            config = self.root / f"{member.name}.yml"
            config.write_text(_member_config(member, self.root, self.etcd_port, bin_dir))
        if account is not None:
            _chown_tree(self.root, account)
        self.wait(self._etcd_answers, 15, "etcd")
        # All three at once: the first to take the initialize key runs
        # initdb, the others wait for it and clone it with pg_basebackup.
        for member in self.members:
            member.proc = self._spawn(member.name, [*python, "-m", "patroni",
                                                     str(self.root / f"{member.name}.yml")],
                                      account, env)
        self.wait(self.healthy, START_TIMEOUT_S, "three streaming members")

    def _etcd_answers(self) -> bool:
        if self.etcd is not None and self.etcd.poll() is not None:
            raise AssertionError(f"etcd exited:\n{self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{self.etcd_port}/health",
                             timeout=1).status_code == 200
        return False

    def _spawn(self, name: str, argv: list[str], account: pwd.struct_passwd | None,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        kwargs: dict[str, Any] = {}
        if account is not None:
            kwargs.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                **kwargs)

    def close(self) -> None:
        # Patroni stops its postgres on SIGTERM; whatever is left after a
        # short wait (a member being killed by the test, a stuck stop) gets
        # SIGKILL, postmasters by their own pid files.
        patronis = [m.proc for m in self.members if m.proc is not None]
        for proc in patronis:
            _signal_group(proc, signal.SIGTERM)
        _wait_all(patronis, 10)
        for proc in patronis:
            _signal_group(proc, signal.SIGKILL)
        for member in self.members:
            pid = member.postmaster_pid()
            if pid is not None and _is_postmaster_of(pid, member.data_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.etcd is not None:
            _signal_group(self.etcd, signal.SIGKILL)
            _wait_all([self.etcd], 5)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def patroni_cluster() -> Iterator[PatroniCluster]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-patroni-"))
    root.chmod(0o755)
    cluster = PatroniCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


# -- helpers ------------------------------------------------------------------


def _runner() -> pwd.struct_passwd | None:
    """Who runs the members: this user, or ``postgres`` when this is root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise AssertionError("running as root, and there is no 'postgres' user to run "
                             "PostgreSQL as (apt-get install postgresql)") from None


def _patroni_python(account: pwd.struct_passwd | None) -> tuple[list[str], dict[str, str]]:
    """An interpreter the members' user can run, that imports this environment's patroni."""
    env = dict(os.environ)
    if account is None or _runs_as(account, [sys.executable, "-c", "import patroni"]):
        return [sys.executable], env
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(f"python{version}", path="/usr/bin:/usr/local/bin")
    site = sysconfig.get_paths()["purelib"]
    env["PYTHONPATH"] = site
    # -S: none of the system's own packages (Debian's dist-packages), which
    # would mix with this environment's (an old pyOpenSSL from Debian over a
    # new cryptography from here failed on import).
    python = [system, "-S"] if system else []
    if python and _runs_as(account, [*python, "-c", "import patroni"], env):
        return python, env
    raise AssertionError(
        f"user {account.pw_name!r} can neither run {sys.executable} nor a system "
        f"python{version} that imports patroni from {site}; make the environment readable")


def _runs_as(account: pwd.struct_passwd, argv: list[str],
             env: dict[str, str] | None = None) -> bool:
    try:
        return subprocess.run(argv, user=account.pw_uid, group=account.pw_gid, extra_groups=[],
                              env=env, capture_output=True, timeout=30, cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _postgres_bin_dir() -> str:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                        key=lambda p: int(Path(p).parent.parent.name))
    if candidates:
        return str(Path(candidates[-1]).parent)
    found = shutil.which("postgres")
    if found:
        return str(Path(found).parent)
    raise AssertionError("no PostgreSQL server binaries found (apt-get install postgresql)")


def _member_config(member: Member, root: Path, etcd_port: int, bin_dir: str) -> str:
    return f"""\
scope: {SCOPE}
name: {member.name}
log: {{level: WARNING}}
restapi:
  listen: 127.0.0.1:{member.api_port}
  connect_address: 127.0.0.1:{member.api_port}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    # A commit waits for one replica, and only that replica may be promoted:
    # with asynchronous replication a leader that dies right after a commit
    # takes it along (seen here: the leader epoch and models acknowledged
    # a second before the kill were gone on the promoted member).
    synchronous_mode: true
    postgresql:
      use_pg_rewind: false
      parameters:
        max_connections: 60
        shared_buffers: 16MB
        fsync: "off"
        full_page_writes: "off"
        wal_keep_size: 64MB
      pg_hba:
      - local all all trust
      - host replication replicator 127.0.0.1/32 trust
      - host all all 127.0.0.1/32 trust
  initdb: [{{encoding: UTF8}}, no-sync]
postgresql:
  listen: 127.0.0.1:{member.pg_port}
  connect_address: 127.0.0.1:{member.pg_port}
  data_dir: {member.data_dir}
  bin_dir: {bin_dir}
  pgpass: {root}/pgpass-{member.name}
  authentication:
    replication: {{username: replicator, password: rep-pass}}
    superuser: {{username: postgres, password: patroni}}
  parameters:
    unix_socket_directories: {root}
  basebackup: [{{checkpoint: fast}}]
"""


def _chown_tree(root: Path, account: pwd.struct_passwd) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid)


def _die_with_parent() -> None:
    """SIGTERM when the test process dies without closing (killed by a timeout, say).

    Patroni stops its postgres on SIGTERM, so a killed test run leaves no
    cluster behind. Set after the switch of user (subprocess does that before
    calling this), which would otherwise clear it.
    """
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))


def _is_postmaster_of(pid: int, data_dir: Path) -> bool:
    """Only kill a pid that still is this member's postmaster (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(data_dir).encode() in cmdline
