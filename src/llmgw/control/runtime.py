"""The control plane's background work: leadership, reconciling, flushing.

The reconcile loop must not die: each pass is guarded, a failed pass is
logged and retried on the next tick, and a pass refused for a stale epoch
means another instance leads now, so this one steps down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmgw.control.gcpause import freeze_survivors
from llmgw.control.leader import LeaderElection
from llmgw.control.nudge import AssignmentWatch, Nudger
from llmgw.control.plane import ControlPlane
from llmgw.control.retention import Retention, prune
from llmgw.control.services.agents import HEARTBEAT_FLUSH_S
from llmgw.errors import NotLeaderError

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 2.0
STANDBY_REFRESH_S = 5.0
# How long start() waits to learn whether this instance leads. The first try
# takes milliseconds; the bound only matters when the store is slow, and then
# the instance starts as a standby and takes over when the election says so.
FIRST_ELECTION_WAIT_S = 5.0


class ControlPlaneRuntime:
    def __init__(
        self,
        cp: ControlPlane,
        *,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
        name: str = "",
        advertise_url: str = "",
        retention: Retention | None = None,
    ) -> None:
        self.cp = cp
        self.retention = retention or Retention()
        self.reconcile_interval_s = reconcile_interval_s
        self.election = LeaderElection(
            cp.store, self._on_leadership, name=name, advertise_url=advertise_url,
            leadership=cp.leadership,
        )
        cp.leadership.on_stale = self._stale
        self._stepping_down: asyncio.Task[None] | None = None
        cp.leader_hint.own_url = advertise_url or None
        # One load at a time: a standby refresh still reading when this
        # instance wins would put its older rows over what the first reports
        # to the new leader just changed.
        self._loading = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._nudger = Nudger(cp.peer_token, cp.node_certs.url, cp.node_certs.client_context)
        self._reconcile_task: asyncio.Task[None] | None = None
        self.passes = 0
        self.last_pass_ms = 0.0

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    async def start(self) -> None:
        # A standby until the election says otherwise: answering an agent
        # before knowing would be acting as a leader that may not be one.
        self.cp.is_leader = False
        self._tasks = [
            asyncio.create_task(self.election.run(), name="leader-election"),
            asyncio.create_task(self._flush_loop(), name="heartbeat-flush"),
            asyncio.create_task(self._standby_refresh(), name="standby-refresh"),
            asyncio.create_task(self._retention_loop(), name="retention"),
        ]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_ELECTION_WAIT_S):
                await self.election.settled.wait()

    async def stop(self) -> None:
        # The lock goes with the election task: from here on another instance
        # may lead, so this one must stop answering as if it did.
        self.cp.is_leader = False
        tasks = [*self._tasks, *([self._reconcile_task] if self._reconcile_task else []),
                 *([self._stepping_down] if self._stepping_down else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.cp.agents.flush_heartbeats()
        await self._nudger.close()

    async def _on_leadership(self, leader: bool, epoch: int) -> None:
        if leader:
            # Whatever the previous leader decided is in the store, not in
            # this instance's memory: read it before acting on it, and before
            # taking reports (a node missing from half-loaded memory would
            # have its token refused and its agent try to register again).
            # The election marks this instance leader when this returns, with
            # no await between: a standby refresh waiting on the lock then
            # sees a leader and leaves the fresh state alone.
            async with self._loading:
                await self.cp.load(leading=True)
                await self.cp.event("leader", self.election.name,
                                    f"{self.election.name} became leader (epoch {epoch})")
                self._reconcile_task = asyncio.create_task(self._reconcile_loop(epoch))
        else:
            if self._reconcile_task is not None:
                self._reconcile_task.cancel()
                self._reconcile_task = None

    async def _reconcile_loop(self, epoch: int) -> None:
        from llmgw.control.reconciler import Reconciler

        reconciler = Reconciler(self.cp.state, self.cp.writes, policy=self.cp.policy)
        assignments = AssignmentWatch(self.cp.state)
        while True:
            started = time.perf_counter()
            result, outcome = None, "ok"
            try:
                now = time.time()
                await self.cp.agents.note_reachability(now)
                result = await reconciler.run_pass(now, epoch)
                # Changes since the last pass, this pass's and those made
                # between passes (a catalog edit, a drain), reach their
                # agents now rather than at their next report.
                nodes = self.cp.state.nodes
                self._nudger.nudge(
                    nodes[n] for n in sorted(assignments.changed(self.cp.state)) if n in nodes
                )
            except NotLeaderError as exc:
                self.cp.metrics.reconcile_pass(time.perf_counter() - started, "stale_epoch", None)
                # The write path has stepped down already (once: _stale does
                # the rest); this covers a refusal raised anywhere else.
                log.warning("reconcile pass refused: %s", exc)
                self.cp.leadership.stale()
                return
            except Exception:
                log.exception("reconcile pass failed; retrying on the next tick")
                outcome = "error"
            self.passes += 1
            self.last_pass_ms = (time.perf_counter() - started) * 1000
            self.cp.metrics.reconcile_pass(self.last_pass_ms / 1000, outcome, result)
            await self.cp.wait_for_wakeup(self.reconcile_interval_s)

    def _stale(self) -> None:
        """A write was refused for a stale epoch: another instance leads."""
        log.warning("%s: a write was refused for a stale epoch; stepping down",
                    self.election.name)
        if self._stepping_down is None or self._stepping_down.done():
            self._stepping_down = asyncio.get_running_loop().create_task(self._step_down())

    async def _step_down(self) -> None:
        task, self._reconcile_task = self._reconcile_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        async with self._loading:
            await self.cp.load()
        # Let go of the lock as well and contend again: an instance that
        # holds it without leading leaves the fleet leaderless.
        await self._restart_election()

    async def _restart_election(self) -> None:
        old = self._tasks[0]
        old.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await old  # its finally releases the lock
        self._tasks[0] = asyncio.create_task(self.election.run(), name="leader-election")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_FLUSH_S)
            try:
                await self.cp.agents.flush_heartbeats()
            except Exception:
                log.exception("flushing heartbeats failed")
            try:
                await self.cp.replicas.flush_activity()
            except Exception:
                log.exception("storing replicas' use failed")
            # A fleet state that grew goes out of the collector's reach, so
            # that collections only walk what was allocated since.
            freeze_survivors()

    async def _retention_loop(self) -> None:
        """The leader deletes events and usage past their retention (llmgw.control.retention)."""
        await asyncio.sleep(min(60.0, self.retention.every_s))
        while True:
            if self.cp.is_leader:
                try:
                    await prune(self.cp.writes, self.retention)
                except Exception:
                    log.exception("pruning old events and usage failed; retrying later")
            await asyncio.sleep(self.retention.every_s)

    async def _standby_refresh(self) -> None:
        """A standby keeps its views close to the store so it can answer reads."""
        while True:
            await asyncio.sleep(STANDBY_REFRESH_S)
            try:
                async with self._loading:
                    if not self.cp.is_leader:
                        await self.cp.load()
            except Exception:
                log.exception("standby refresh failed")
