"""Which control-plane instance runs the reconciler.

Two reconcilers placing replicas at once would hand one GPU to two
replicas, so exactly one instance leads; the others serve as hot standbys.

- PostgreSQL: a session advisory lock held on a dedicated connection. The
  lock lives exactly as long as that connection, so a leader whose process
  dies or whose connection breaks (a Patroni failover terminates it) loses
  it, and a standby's next try wins. The leader checks its connection every
  second and steps down on any error rather than trusting a lock it can no
  longer prove it holds.
- SQLite: an exclusive ``flock`` on a file beside the database; one machine,
  so the kernel's lock is the whole story.

Winning bumps the store's leader epoch; every write of the control plane
carries it (llmgw.control.writes) and the store refuses writes from an older
epoch (Store.fenced), so a deposed leader that wakes up late cannot
overwrite its successor's decisions, and steps down at its first refusal.

Whether this instance leads, and under which epoch, lives in one
:class:`Leadership` object that the election owns and everything else reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from llmgw.control.store.db import libpq_conninfo
from llmgw.control.store.repo import Store

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 73110002
CHECK_INTERVAL_S = 1.0
RETRY_INTERVAL_S = 1.0

OnChange = Callable[[bool, int], Awaitable[None]]


@dataclass
class Leadership:
    """Whether this instance leads, and the epoch its writes carry.

    One object, changed by the election (and by a refused write), read by
    the control plane, its runtime and the write path: one flag, since
    flags kept in step from outside (election, control plane, runtime) let
    a step-down that reaches one of them leave another acting as leader.

    With no election (tests, benchmarks, an embedded control plane) the
    instance is the only one: it leads and its writes carry no epoch.
    """

    is_leader: bool = True
    epoch: int | None = None
    # Called once when a write is refused for a stale epoch: the runtime lets
    # go of the lock and contends again.
    on_stale: Callable[[], None] | None = None

    def stale(self) -> None:
        """A write under this epoch was refused: another instance leads now."""
        if self.is_leader:
            self.is_leader = False
            if self.on_stale is not None:
                self.on_stale()


class LeaderElection:
    """Runs until cancelled, calling ``on_change(is_leader, epoch)`` on each change."""

    def __init__(
        self,
        store: Store,
        on_change: OnChange,
        *,
        name: str = "",
        advertise_url: str = "",
        leadership: Leadership | None = None,
    ) -> None:
        self.store = store
        self.on_change = on_change
        self.name = name or f"pid-{os.getpid()}"
        # Recorded with the epoch on winning, so standbys can send clients here.
        self.advertise_url = advertise_url
        # A standby until it wins; every write is fenced from here on.
        self.leadership = leadership or Leadership()
        self.leadership.is_leader = False
        self.leadership.epoch = 0
        # Set once the first try has an outcome (won, lost, or failed), so a
        # starting instance knows its role before it answers anyone.
        self.settled = asyncio.Event()

    async def run(self) -> None:
        if self.store.is_sqlite:
            await self._run_flock()
        else:
            await self._run_advisory_lock()

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @property
    def epoch(self) -> int:
        return self.leadership.epoch or 0

    async def _become(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        leadership = self.leadership
        if leader:
            # The epoch first, so what on_change writes (it loads the state
            # and records the event) is fenced; leading only once it returned,
            # so nothing is answered from half-loaded memory. No await comes
            # between its return and the flag.
            leadership.epoch = await self.store.bump_epoch(self.advertise_url)
            await self.on_change(True, leadership.epoch)
            leadership.is_leader = True
        else:
            leadership.is_leader = False
            await self.on_change(False, self.epoch)
        log.info("%s %s (epoch %d)", self.name,
                 "became leader" if leader else "stepped down", self.epoch)

    # -- SQLite ------------------------------------------------------------

    async def _run_flock(self) -> None:
        database = make_url(self.store.url).database or "llmgw.db"
        lock_path = Path(database + ".leader")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.settled.set()
                    await asyncio.sleep(RETRY_INTERVAL_S)
            try:
                await self._become(True)
            finally:
                self.settled.set()
            await asyncio.Event().wait()  # hold until cancelled
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- PostgreSQL ----------------------------------------------------------

    async def _run_advisory_lock(self) -> None:
        import psycopg

        conninfo = _libpq_url(self.store.url)
        while True:
            conn: Any = None
            try:
                conn = await psycopg.AsyncConnection.connect(
                    conninfo, autocommit=True, connect_timeout=5
                )
                while True:
                    cur = await conn.execute(
                        "SELECT pg_try_advisory_lock(%s)", (ADVISORY_LOCK_KEY,)
                    )
                    row = await cur.fetchone()
                    if row and row[0]:
                        break
                    self.settled.set()
                    await asyncio.sleep(RETRY_INTERVAL_S)
                await self._become(True)
                self.settled.set()
                while True:
                    await asyncio.sleep(CHECK_INTERVAL_S)
                    # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a
                    # cancel that lands as the query completes, and this loop then
                    # outlived the runtime's stop (a serve on PostgreSQL hung on
                    # SIGTERM with this task "cancelling" for minutes).
                    async with asyncio.timeout(5):
                        await conn.execute("SELECT 1")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any error of the lock connection: step down
                log.warning("leader lock connection failed: %s", exc)
                self.settled.set()
                await self._become(False)
                await asyncio.sleep(RETRY_INTERVAL_S)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()


def _libpq_url(sqlalchemy_url: str) -> str:
    # Every host of a multi-host (Patroni) URL: the lock must follow the
    # primary to whichever member it moves, like the pool does.
    return libpq_conninfo(sqlalchemy_url)
