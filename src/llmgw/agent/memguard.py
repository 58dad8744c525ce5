"""Holding each engine to its memory budget: a cgroup where the agent can make one, else RSS.

An engine that outgrows the machine is ended by the kernel's OOM killer,
which picks by size and may pick anything: another engine, the agent, a
user's browser. The agent instead gives every engine a budget
(llmgw.memory) and fails the replica that exceeds it, with a reason that
says so.

- **cgroup** (v1 ``memory`` or v2 with the memory controller; the agent
  needs write access, as root on this kind of machine): the engine runs in a
  cgroup of its own under the agent's, limited to its budget plus a margin.
  The agent kills the engine once its usage passes the budget, which it
  reads each monitor tick; an engine that grows faster than that meets the
  limit and is killed by the kernel *inside its own cgroup*, and the cgroup's
  ``oom_kill`` count says that this is what happened. Nothing outside the
  engine is ever chosen.
- **rss** (no cgroup to be had): the agent sums the resident memory of the
  engine's process tree each tick and kills it past the budget. An engine
  killed by SIGKILL while the kernel's OOM counter moved is named as an OOM
  kill.

The usage figure is resident anonymous memory plus mapped files (the
memory-mapped weights), what RSS shows: page cache the engine merely read
through does not count, since the kernel reclaims it under pressure.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import psutil

from llmgw import memory

log = logging.getLogger("llmgw.agent.memguard")

GuardMode = Literal["auto", "cgroup", "rss", "off"]

# The cgroup's hard limit is the budget plus this margin: the agent's own
# check (a clear reason, a clean kill) comes first, the kernel's only for an
# engine that grows by more than the margin within one tick.
HARD_MARGIN_MIB = 64
HARD_MARGIN_SHARE = 0.10

_SAFE_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")


class MemoryWatch(Protocol):
    """One engine's memory, as its guard sees it."""

    kind: str  # "cgroup v1", "cgroup v2", "rss": shown in reasons
    budget_bytes: int

    def used(self) -> int | None:
        """Bytes in use now; None when it cannot be read (e.g. the engine just exited)."""

    def peak(self) -> int | None:
        """The most seen in use, where the kernel keeps it; else None."""

    def oom_kills(self) -> int:
        """Processes of this engine the kernel's OOM killer ended since it was attached."""

    def close(self) -> None:
        """Forget the engine (remove its cgroup once its processes are gone)."""


@dataclass(frozen=True)
class Overrun:
    used_bytes: int
    budget_bytes: int
    kind: str


def check(watch: MemoryWatch) -> Overrun | None:
    """An Overrun when the engine uses more than its budget, else None."""
    used = watch.used()
    if used is None or used <= watch.budget_bytes:
        return None
    return Overrun(used, watch.budget_bytes, watch.kind)


def hard_limit(budget_bytes: int) -> int:
    margin = max(HARD_MARGIN_MIB * memory.MIB, int(budget_bytes * HARD_MARGIN_SHARE))
    return budget_bytes + margin


# ---------------------------------------------------------------------------
# RSS watching
# ---------------------------------------------------------------------------


class RssWatch:
    """The resident memory of the engine's process tree, read with psutil."""

    kind = "rss"

    def __init__(self, pid: int, budget_bytes: int) -> None:
        self.pid = pid
        self.budget_bytes = budget_bytes
        self._peak = 0
        self._oom_at_start = vmstat_oom_kills()

    def used(self) -> int | None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        self._peak = max(self._peak, total)
        return total

    def peak(self) -> int | None:
        return self._peak or None

    def oom_kills(self) -> int:
        # Machine-wide: no cgroup says whose; the caller only believes it for
        # an engine that died by SIGKILL while the count moved.
        now = vmstat_oom_kills()
        if now is None or self._oom_at_start is None:
            return 0
        return max(0, now - self._oom_at_start)

    def close(self) -> None:
        return None


def vmstat_oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat, Linux 4.13+)."""
    try:
        with open("/proc/vmstat", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# ---------------------------------------------------------------------------
# cgroups
# ---------------------------------------------------------------------------


class CgroupWatch:
    """One engine's own memory cgroup (v1 or v2)."""

    def __init__(self, path: Path, version: int, budget_bytes: int) -> None:
        self.path = path
        self.version = version
        self.kind = f"cgroup v{version}"
        self.budget_bytes = budget_bytes
        self._oom_at_start = self._oom_count()

    def used(self) -> int | None:
        stat = _read_keyed(self.path / "memory.stat")
        if not stat:
            return None
        if self.version == 1:
            return stat.get("total_rss", 0) + stat.get("total_mapped_file", 0)
        return stat.get("anon", 0) + stat.get("file_mapped", 0)

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_int(self.path / name)

    def resize(self, budget_bytes: int) -> None:
        """A new budget, and the cgroup's hard limit with it (a sleeping engine's weights)."""
        self.budget_bytes = budget_bytes
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        with contextlib.suppress(OSError):
            (self.path / name).write_text(str(hard_limit(budget_bytes)))

    def oom_kills(self) -> int:
        return max(0, self._oom_count() - self._oom_at_start)

    def _oom_count(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return _read_keyed(self.path / name).get("oom_kill", 0)

    def close(self) -> None:
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            # EBUSY: a process of the engine is still in it; left for the
            # next agent start, which removes empty leftovers.
            log.warning("cannot remove cgroup %s: %s", self.path, exc)


@dataclass(frozen=True)
class CgroupParent:
    """Where engine cgroups are made: under the agent's own cgroup."""

    path: Path
    version: int

    @classmethod
    def find(cls) -> CgroupParent | None:
        """The agent's own memory cgroup if engines can get cgroups under it, else None."""
        for parent, version in _own_memory_cgroups():
            if not os.access(parent, os.W_OK):
                continue
            if version == 2 and not _enable_v2_memory(parent):
                continue
            return cls(parent, version)
        return None

    def attach(self, name: str, pid: int, budget_bytes: int) -> CgroupWatch:
        """Put process ``pid`` (and what it forks later) into cgroup ``name``, limited."""
        path = self.path / name
        path.mkdir(exist_ok=True)
        limit = str(hard_limit(budget_bytes))
        if self.version == 1:
            (path / "memory.limit_in_bytes").write_text(limit)
            # Without swap accounting (or swap) this file is absent or refuses.
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(limit)
        else:
            (path / "memory.max").write_text(limit)
            # An engine that swaps is as good as stopped; limit RAM, not RAM + swap.
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        (path / "cgroup.procs").write_text(str(pid))
        return CgroupWatch(path, self.version, budget_bytes)

    def remove_leftovers(self, prefix: str) -> None:
        """Remove empty engine cgroups a previous agent left (it died before cleaning up)."""
        with contextlib.suppress(OSError):
            for child in self.path.iterdir():
                if child.name.startswith(prefix) and child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()  # refused while processes are in it: adopted later


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path; "" for the v2 hierarchy."""
    found: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            found[controller] = parts[2]
    return found


def _own_memory_cgroups() -> Iterator[tuple[Path, int]]:
    """The agent's own memory cgroup (path, version) under each memory hierarchy mounted."""
    own = _own_cgroups()
    for mount, version in _memory_mounts():
        relative = own.get("memory" if version == 1 else "")
        if relative is not None:
            yield mount / relative.lstrip("/"), version


def _memory_mounts() -> list[tuple[Path, int]]:
    """Mount points of hierarchies with the memory controller: (path, version), v2 first."""
    found: list[tuple[Path, int]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, extra = left.split(), right.split()
        if len(fields) < 5 or len(extra) < 3:
            continue
        if extra[0] == "cgroup2":
            found.insert(0, (Path(fields[4]), 2))
        elif extra[0] == "cgroup" and "memory" in extra[2].split(","):
            found.append((Path(fields[4]), 1))
    return found


def _enable_v2_memory(parent: Path) -> bool:
    """Whether children of ``parent`` can have memory limits (cgroup v2)."""
    try:
        controllers = (parent / "cgroup.controllers").read_text().split()
        if "memory" not in controllers:
            return False
        if "memory" in (parent / "cgroup.subtree_control").read_text().split():
            return True
        # Refused (EBUSY) in a cgroup that holds processes, the agent among
        # them, unless it is the root: run the agent in a delegated cgroup
        # of its own (systemd Delegate=yes) to get engine cgroups there.
        (parent / "cgroup.subtree_control").write_text("+memory")
        return True
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EACCES, errno.EPERM, errno.ENOENT):
            log.warning("cgroup v2 at %s: %s", parent, exc)
        return False


def _read_keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------
# The guard the agent holds
# ---------------------------------------------------------------------------


def agent_tag(data_dir: Path) -> str:
    """The tag of the agent of ``data_dir`` in its engines' cgroup names."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]


class MemoryGuard:
    """Gives each engine of one agent a watch over its memory.

    ``tag`` tells this agent's engine cgroups from another agent's on the
    same machine (tests run several; a node may run more than one agent).
    """

    def __init__(self, tag: str, mode: GuardMode = "auto") -> None:
        self.mode = mode
        self.prefix = f"llmgw-{_SAFE_NAME_RE.sub('_', tag)[:40]}-"
        self._parent: CgroupParent | None = None
        if mode in ("auto", "cgroup"):
            self._parent = CgroupParent.find()
            if self._parent is None and mode == "cgroup":
                log.warning("no writable memory cgroup: watching engines' RSS instead")
        if self._parent is not None:
            self._parent.remove_leftovers(self.prefix)

    @property
    def kind(self) -> str:
        if self.mode == "off":
            return "off"
        return f"cgroup v{self._parent.version}" if self._parent else "rss"

    def attach(self, replica_id: str, pid: int, budget_bytes: int) -> MemoryWatch | None:
        """Start holding engine ``pid`` of ``replica_id`` to ``budget_bytes``; None when off."""
        if self.mode == "off":
            return None
        if self._parent is not None:
            name = self.prefix + _SAFE_NAME_RE.sub("_", replica_id)[:100]
            try:
                return self._parent.attach(name, pid, budget_bytes)
            except OSError as exc:
                log.warning("cgroup for %s: %s; watching its RSS instead", replica_id, exc)
        return RssWatch(pid, budget_bytes)


class EngineMemory:
    """One replica's memory budget and its watch, and the reasons it fails the replica with."""

    def __init__(self, guard: MemoryGuard | None, budget_mib: int, advice: str) -> None:
        self.guard = guard
        self.budget_mib = budget_mib
        self.advice = advice  # what to change, e.g. "raise memory_mib ... or lower the context"
        self.watch: MemoryWatch | None = None
        self.asleep_mib = 0  # weights held in RAM while the engine sleeps

    @property
    def budget_bytes(self) -> int:
        return self.budget_mib * memory.MIB

    def attach(self, replica_id: str, pid: int) -> None:
        if self.guard is not None and self.watch is None:
            self.watch = self.guard.attach(replica_id, pid, self.budget_bytes)

    def hold_asleep(self, weights_mib: int) -> None:
        """Count (``weights_mib`` > 0) or stop counting (0) a sleeping engine's weights.

        An engine asleep keeps its weights in host RAM (vLLM's sleep level 1
        copies them there): its budget grows by them while it sleeps, or the
        guard would kill the engine for doing what it was told.
        """
        self.asleep_mib = weights_mib
        watch = self.watch
        if watch is None:
            return
        budget = (self.budget_mib + weights_mib) * memory.MIB
        if isinstance(watch, CgroupWatch):
            watch.resize(budget)
        else:
            watch.budget_bytes = budget

    def overrun(self) -> str | None:
        """The reason to kill the engine for, when it uses more than its budget."""
        if self.watch is None:
            return None
        found = check(self.watch)
        if found is None:
            return None
        used = memory.budget_sentence(found.used_bytes, found.budget_bytes)
        return f"out of memory budget: engine {used} ({found.kind}); killed. {self.advice}"

    def exit_reason(self, code: int | None) -> str | None:
        """An OOM kill named as such, when the engine's exit was one; else None.

        In its own cgroup any OOM kill is the engine's, also one of a worker
        after which the leader exited with an error of its own. Machine-wide
        (RSS watching) only a SIGKILL while the kernel's count moved is.
        """
        watch = self.watch
        if watch is None or not watch.oom_kills():
            return None
        if isinstance(watch, CgroupWatch):
            where = f"at its memory limit ({watch.kind})"
        elif code == -signal.SIGKILL:
            where = "while the node ran out of memory"
        else:
            return None
        peak = max(watch.peak() or 0, watch.used() or 0)
        used = memory.budget_sentence(peak, watch.budget_bytes) if peak else "ran out"
        return f"killed by the kernel's OOM killer {where}: engine {used}. {self.advice}"

    def close(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.close()


def node_memory_mib() -> int:
    """The RAM this agent's engines can have: the machine's, or its own cgroup's limit if lower.

    In a container the machine's figure is the host's, and engines placed
    against it would meet the container's limit instead.
    """
    total = int(psutil.virtual_memory().total)
    for path, version in _own_memory_cgroups():
        name = "memory.limit_in_bytes" if version == 1 else "memory.max"
        limit = _read_int(path / name)  # None also for v2's "max"
        if limit is not None and 0 < limit < total:
            total = limit
    return total // memory.MIB
