"""One replica's life on this node: weights, port, engine, readiness, watch, stop.

Each replica is a task of its own, so a 40 GB download or a 10-minute engine
load never holds up the agent's reports or the other replicas. The task only
ever moves forward (starting -> ready -> failed); a restart is a new runner,
created by the agent when the control plane sends a new generation.

The state a report needs (state, reason, port, progress) lives on the runner
and is read without waiting, so building a report never blocks on a process.

Once ready, the engine is watched three ways: its process (an exit fails the
replica at once), its HTTP server (a sustained run of failed probes, see
:mod:`llmgw.agent.liveness`, gets it killed and failed), because a deadlocked
engine keeps its process and would otherwise stay READY forever, and, where
its adapter names them, its metrics (requests running while the token
counters stand still, see :mod:`llmgw.agent.progress`), because an engine
stuck inside a CUDA call may still answer its health path.

An engine with a key that serves HTTP is started by its guard
(:mod:`llmgw.agent.replicalaunch`); the agent's own probes go to the engine
on loopback directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import aiohttp

from llmgw import memory
from llmgw.agent.engineprobe import EngineEndpoint
from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.loras import EngineControl, engine_control, start_adapters
from llmgw.agent.memguard import EngineMemory
from llmgw.agent.progress import MetricsError, ProgressMetrics
from llmgw.agent.replicalaunch import (
    engine_endpoint,
    engine_launch,
    engine_port_id,
    fetch_weights,
    launch_context,
    release_ports,
    restore_ports,
)
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.servingwatch import ServingWatch, Verdict
from llmgw.agent.state import EngineRecord
from llmgw.agent.supervisor import EngineProcess, ExitStatus, describe_exit
from llmgw.agent.weights import Progress
from llmgw.errors import EngineError
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    Device,
    EngineDialect,
    ReplicaAssignment,
    ReplicaState,
    ReplicaStatus,
)

log = logging.getLogger("llmgw.agent.replicas")

HEALTH_TIMEOUT_S = 2.0
# How often an engine still starting after its first 10 s is probed.
SLOW_POLL_S = 0.1
LOG_ROTATE_EVERY_S = 30.0
REASON_LINES = 3


class ReplicaRunner:
    def __init__(
        self,
        assignment: ReplicaAssignment,
        adapter: EngineAdapter,
        devices: Sequence[Device],
        deps: RunnerDeps,
        *,
        after: Sequence[asyncio.Task[None]] = (),
    ) -> None:
        self.assignment = assignment
        self.adapter = adapter
        self.devices = list(devices)
        self.deps = deps
        self.after = list(after)  # stops to finish first (same id or same devices)
        self.state = ReplicaState.STARTING
        self.reason: str | None = "waiting to start"
        self.port: int | None = None  # advertised: the engine's, or its guard's
        self.engine_port: int | None = None  # a guarded engine's loopback port
        self.proc: EngineProcess | None = None
        self.exit_code: int | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.progress: Progress | None = None
        self.health_path: str | None = "/health"
        self.liveness_path: str | None = "/health"
        self.metrics: ProgressMetrics | None = None
        self.dialect: EngineDialect | None = None  # the adapter's, once built
        self.tls = False  # the engine listens with TLS (EngineLaunch.tls)
        self.memory: EngineMemory | None = None  # once the budget is known
        self._serving = ServingWatch(assignment.replica_id, deps.liveness)
        self._task: asyncio.Task[None] | None = None
        self._weights_key: str | None = None  # held while starting or running
        self.control = EngineControl(assignment.replica_id)  # adapters, sleep (agent.loras)

    @property
    def replica_id(self) -> str:
        return self.assignment.replica_id

    @property
    def generation(self) -> int:
        return self.assignment.generation

    # -- control ---------------------------------------------------------------

    def start(self) -> None:
        # Held from the start, before the fetch: weights another replica's
        # fetch evicts in between would have to come back over the network.
        if self._weights_key is None:
            self._weights_key = self.deps.weights.hold(self.assignment.model)
        self._task = asyncio.create_task(self._life(), name=f"replica-{self.replica_id}")

    def adopt(self, record: EngineRecord) -> None:
        """Take over an engine a previous agent started (see :mod:`llmgw.agent.state`)."""
        self.port = record.port
        self.started_at = record.started_at
        self.health_path = record.health_path
        self.liveness_path = record.liveness_path
        self.metrics = record.progress
        self.dialect = record.dialect
        self.control.adopted(record.dialect, self.assignment.adapters, self.deps.weights.hold)
        self.tls = record.tls
        self.deps.ports.restore(self.replica_id, record.port)
        self.engine_port = record.engine_port
        restore_ports(self.deps.ports, self.replica_id, record.engine_port)
        if record.failed:
            self._mark_failed(record.reason or "failed", record.exit_code, persist=False)
            return
        proc = None
        if record.pid is not None and record.birth is not None:
            proc = self.deps.supervisor.adopt(record.pid, record.birth)
        elif (stray := self.deps.supervisor.find(self.replica_id)) is not None:
            # Started, but the agent went away before it wrote the pid down,
            # and so before it held the engine to its memory budget: not one
            # to keep serving. The control plane starts the replica again.
            self.proc = stray
            self._mark_failed("the agent stopped while starting this engine; engine stopped", None)
            self._task = asyncio.create_task(
                self._stop_stray(stray), name=f"replica-{self.replica_id}"
            )
            return
        if proc is None:
            self._mark_failed(describe_exit(None) + self._last_words(), None)
            return
        self.proc = proc
        if record.memory_budget_mib is not None:
            self._hold_memory(record.memory_budget_mib)
        if record.ready_at is not None:
            # It served before the agent went away and the very same process
            # still runs: keep routing to it instead of a starting blip.
            self.state = ReplicaState.READY
            self.ready_at = record.ready_at
            self.reason = None
        else:
            self.reason = "engine loading (adopted)"
        self.start()

    async def _stop_stray(self, proc: EngineProcess) -> None:
        status = await self.deps.supervisor.stop(proc, self.deps.stop_grace_s)
        log.warning(
            "replica %s: stopped engine pid %d, started but never recorded: %s",
            self.replica_id,
            proc.pid,
            describe_exit(status.code),
        )
        self.proc = None  # its pid may be handed out again; never signal it twice

    async def stop(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL) and forget the replica."""
        await self._cancel_task()
        if self.proc is not None:
            status = await self.deps.supervisor.stop(self.proc, self.deps.stop_grace_s)
            log.info("stopped %s: %s", self.replica_id, describe_exit(status.code))
        self.deps.state.remove(self.replica_id)
        release_ports(self.deps.ports, self.replica_id)
        self._release_weights()
        self._release_memory()

    async def detach(self) -> None:
        """Stop watching but leave the engine running, for the next agent to adopt."""
        await self._cancel_task()
        self._release_weights()  # the next agent holds them again when it adopts

    def _release_memory(self) -> None:
        if self.memory is not None:
            self.memory.close()  # the engine's cgroup, once its processes are gone

    def _release_weights(self) -> None:
        key, self._weights_key = self._weights_key, None
        if key is not None:
            self.deps.weights.release(key)
        self.control.release_all(self.deps.weights.release)

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    # -- reporting -------------------------------------------------------------

    def status(self) -> ReplicaStatus:
        state = self.state
        if self.assignment.draining and state != ReplicaState.FAILED:
            state = ReplicaState.DRAINING
        reason = self.reason
        download = None
        if self.progress is not None:
            download = self.progress.snapshot()
            reason = f"fetching weights {self.progress.percent()}"
        # Its adapters and sleep are agent.loras' to say.
        return self.control.report(ReplicaStatus(
            replica_id=self.replica_id, generation=self.generation, state=state,
            port=self.port, pid=self.proc.pid if self.proc else None,
            exit_code=self.exit_code, reason=reason, log_tail=self._log_tail(),
            download=download, started_at=self.started_at, ready_at=self.ready_at,
            dialect=self.dialect, tls=self.tls,
        ))

    # -- the life of a replica ---------------------------------------------------

    async def _life(self) -> None:
        try:
            for task in self.after:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.shield(task)
            if self.proc is None:
                await self._launch()
            if self.state == ReplicaState.STARTING:
                await self._wait_ready()
            async with engine_control(self, self.state == ReplicaState.READY):
                await self._watch()
        except asyncio.CancelledError:
            raise
        except EngineError as exc:
            await self._fail(str(exc))
        except Exception as exc:
            log.exception("replica %s", self.replica_id)
            await self._fail(f"agent error: {type(exc).__name__}: {exc}")

    async def _launch(self) -> None:
        spec = self.assignment.model
        deps = self.deps
        self.adapter.validate(self.assignment)
        if spec.weights.kind != "none":
            self._set(ReplicaState.STARTING, "fetching weights")
            self.progress = Progress()
            try:
                path = await fetch_weights(deps, spec, self.progress)
            finally:
                self.progress = None
        else:
            path = None
        adapters = await start_adapters(deps, self.control, self.assignment.adapters,
                                        self.adapter.adapters_at_start)  # fmt: skip
        self.port = deps.ports.allocate(self.replica_id)
        ctx, budget = await launch_context(self.assignment, self.devices, deps, path, self.port,
                                           adapters)  # fmt: skip
        self.control.weights_bytes = ctx.weights_bytes  # in RAM while it sleeps
        launch, self.engine_port = engine_launch(
            self.adapter, ctx, lambda: deps.ports.allocate(engine_port_id(self.replica_id))
        )
        self.health_path = launch.health_path
        self.liveness_path = launch.serving_probe
        self.metrics = launch.progress if launch.serving_probe is not None else None
        self.dialect = launch.dialect
        self.tls = launch.tls
        self.started_at = time.time()
        # The record (and so the port) is on disk before the process exists:
        # an agent that dies right after the spawn still knows the port is taken.
        record = self._record()
        deps.state.put(record)
        if deps.engine_user is not None:
            await asyncio.to_thread(deps.engine_user.grant_weights, deps.weights.root, path)
        self.proc = deps.supervisor.spawn(self.replica_id, launch)
        self._hold_memory(budget)
        deps.state.put(self._record())
        log.info(
            "started %s (%s) pid %d port %d", self.replica_id, spec.name, self.proc.pid, self.port
        )
        self._set(ReplicaState.STARTING, "engine loading")

    async def _wait_ready(self) -> None:
        proc = self._proc()
        timeout = self.assignment.model.start_timeout_s
        deadline = (self.started_at or time.time()) + timeout
        began = time.monotonic()
        while not await self._ended(proc):
            path = self.health_path
            if path is None or await self._probe(path, HEALTH_TIMEOUT_S) is None:
                self.ready_at = time.time()
                self.deps.state.put(self._record())
                self._set(ReplicaState.READY, None)
                return
            if time.time() > deadline:
                await self.deps.supervisor.stop(proc, self.deps.stop_grace_s)
                await self._fail(f"engine not ready after {timeout:g} s (start timeout)")
                return
            # Poll quickly at first (the simulated engine is up in a second,
            # llama.cpp with a small model in a few), then gently: a GPU engine
            # takes minutes, and a tenth of a second is nothing beside them.
            slow = time.monotonic() - began > 10.0
            await asyncio.sleep(max(SLOW_POLL_S, self.deps.poll_s) if slow else self.deps.poll_s)

    async def _watch(self) -> None:
        if self.state == ReplicaState.FAILED:
            return
        proc = self._proc()
        liveness = self.deps.liveness
        last_rotate = time.monotonic()
        next_probe = time.monotonic() + liveness.interval_s
        while not await self._ended(proc):
            if time.monotonic() - last_rotate > LOG_ROTATE_EVERY_S:
                await asyncio.to_thread(self.deps.supervisor.rotate_if_large, self.replica_id)
                last_rotate = time.monotonic()
            if self.liveness_path is not None and time.monotonic() >= next_probe:
                if await self._hung(proc, self.liveness_path):
                    return
                # An engine that does not answer is the probe's to judge;
                # scraping it as well would only time out a second time.
                metrics = None if self._serving.probes.failing else self.metrics
                if metrics is not None and await self._stalled(proc, metrics):
                    return
                next_probe = time.monotonic() + liveness.interval_s
            wait = self.deps.monitor_s
            if self.liveness_path is not None:
                wait = min(wait, max(0.0, next_probe - time.monotonic()))
            await asyncio.sleep(wait)

    async def _hung(self, proc: EngineProcess, path: str) -> bool:
        """Probe a serving engine; kill and fail it once it has been hung long enough.

        True when the replica failed (hung, or its process turned out to be gone).
        """
        began, began_wall = time.monotonic(), time.time()
        error = await self._probe(path, self.deps.liveness.timeout_s)
        verdict = self._serving.probed(path, error, began, began_wall, time.monotonic())
        return await self._act_on(proc, verdict)

    async def _stalled(self, proc: EngineProcess, metrics: ProgressMetrics) -> bool:
        """Scrape a serving engine's metrics; kill and fail it once it has stalled long enough.

        True when the replica failed (stalled, or its process turned out to be gone).
        """
        began, began_wall = time.monotonic(), time.time()
        try:
            running, counters = await self._scrape(metrics)
        except (MetricsError, TimeoutError, aiohttp.ClientError, OSError) as exc:
            # Not a stall: the engine may just be between restarts of its
            # metrics, and one that stopped answering is the probe's to catch.
            # The still run is kept: no scrape says the counters moved.
            log.debug("replica %s: metrics %s: %s", self.replica_id, metrics.path, exc)
            return False
        verdict = self._serving.scraped(running, counters, began, began_wall, time.monotonic())
        return await self._act_on(proc, verdict)

    async def _act_on(self, proc: EngineProcess, verdict: Verdict | None) -> bool:
        """Show what the watch judged, or kill the engine for it; True when it was killed."""
        if verdict is None:
            return False
        if verdict.kill and verdict.reason is not None:
            await self._kill_and_fail(proc, verdict.reason)
            return True
        self._set(self.state, verdict.reason, notify=verdict.notify)
        return False

    async def _kill_and_fail(
        self, proc: EngineProcess, reason: str, grace_s: float | None = None
    ) -> None:
        """Stop an engine judged hung, stalled or over budget; fail its replica with ``reason``."""
        status = self.deps.supervisor.poll(proc)
        if status.exited:  # the check failed because the engine had just exited
            await self._exited(status)
            return
        log.error("replica %s: %s; stopping it", self.replica_id, reason)
        grace = self.deps.stop_grace_s if grace_s is None else grace_s
        stopped = await self.deps.supervisor.stop(proc, grace)
        await self._fail(reason + self._last_words(), stopped.code)

    def _endpoint(self) -> EngineEndpoint:
        return engine_endpoint(
            self.deps, self.assignment.engine_key, self.port, self.engine_port, self.tls
        )

    async def _probe(self, path: str, timeout_s: float) -> str | None:
        """GET ``path`` on the engine: None when it answers 200, else what went wrong."""
        return await self._endpoint().probe(path, timeout_s)

    async def _scrape(self, metrics: ProgressMetrics) -> tuple[float, tuple[float, ...]]:
        return await self._endpoint().scrape(metrics, self.deps.liveness.timeout_s)

    def _hold_memory(self, budget_mib: int) -> None:
        """Hold the engine to ``budget_mib`` (agent.memguard) from now on."""
        spec = self.assignment.model
        self.memory = EngineMemory(self.deps.memory, budget_mib, memory.advice(spec, budget_mib))
        if self.proc is not None:
            try:
                self.memory.attach(self.replica_id, self.proc.pid)
            except OSError as exc:  # e.g. the engine exited at once
                log.warning("replica %s: memory watch: %s", self.replica_id, exc)

    async def _ended(self, proc: EngineProcess) -> bool:
        """Whether the engine exited or went over its memory budget (its replica failed)."""
        status = self.deps.supervisor.poll(proc)
        if status.exited:
            await self._exited(status)
            return True
        return await self._over_budget(proc)

    async def _over_budget(self, proc: EngineProcess) -> bool:
        """Kill and fail an engine that uses more than its memory budget; True when it did."""
        reason = self.memory.overrun() if self.memory is not None else None
        if reason is None:
            return False
        # At once: an engine past its budget keeps growing through a grace
        # period, and what it would finish is not worth the node's memory.
        await self._kill_and_fail(proc, reason, grace_s=0.0)
        return True

    async def _exited(self, status: ExitStatus) -> None:
        # The leader is gone; workers it forked into its group may linger
        # with GPU memory. Make sure they go too.
        if self.proc is not None:
            await self.deps.supervisor.stop(self.proc, 0.0)
        oom = self.memory.exit_reason(status.code) if self.memory is not None else None
        reason = oom or describe_exit(status.code)
        await self._fail(reason + self._last_words(), status.code)

    async def _fail(self, reason: str, exit_code: int | None = None) -> None:
        self._mark_failed(reason, exit_code)

    def _mark_failed(self, reason: str, exit_code: int | None, *, persist: bool = True) -> None:
        self.exit_code = exit_code
        self._release_weights()  # no engine reads them any more
        self._release_memory()
        log.warning("replica %s failed: %s", self.replica_id, reason)
        self._set(ReplicaState.FAILED, reason)
        if persist and self.port is not None:
            self.deps.state.put(self._record())

    def _last_words(self) -> str:
        tail = self._log_tail(REASON_LINES)
        return f"; last output: {' | '.join(tail)}" if tail else ""

    def _log_tail(self, lines: int | None = None) -> list[str]:
        """The engine's last log lines, without its engine key.

        Both go to the control plane and every admin read. Engines may print
        their key: SGLang logs every server argument, ``api_key`` included,
        in its start line (``server_args=...``, entrypoints/engine.py).
        """
        supervisor, key = self.deps.supervisor, self.assignment.engine_key
        if lines is None:
            return supervisor.log_tail(self.replica_id, secret=key)
        return supervisor.log_tail(self.replica_id, lines, secret=key)

    def _set(self, state: ReplicaState, reason: str | None, *, notify: bool = False) -> None:
        changed = state != self.state
        self.state = state
        self.reason = reason
        if changed or notify:
            self.deps.on_change()

    def _proc(self) -> EngineProcess:
        if self.proc is None:
            raise EngineError(f"replica {self.replica_id} has no engine process")
        return self.proc

    def _record(self) -> EngineRecord:
        return EngineRecord(
            replica_id=self.replica_id,
            generation=self.generation,
            model=self.assignment.model.name,
            assignment=self.assignment,
            port=self.port or 0,
            engine_port=self.engine_port,
            pid=self.proc.pid if self.proc else None,
            birth=self.proc.birth if self.proc else None,
            health_path=self.health_path,
            liveness_path=self.liveness_path,
            progress=self.metrics,
            dialect=self.dialect,
            tls=self.tls,
            started_at=self.started_at,
            ready_at=self.ready_at,
            memory_budget_mib=self.memory.budget_mib if self.memory else None,
            failed=self.state == ReplicaState.FAILED,
            exit_code=self.exit_code,
            reason=self.reason if self.state == ReplicaState.FAILED else None,
        )
