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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from llmgw import memory
from llmgw.agent.engines.base import EngineAdapter, EngineTls, LaunchContext
from llmgw.agent.liveness import FailedProbes, Liveness
from llmgw.agent.memguard import EngineMemory, MemoryGuard
from llmgw.agent.ports import PortAllocator
from llmgw.agent.progress import (
    MAX_METRICS_BYTES,
    MetricsError,
    ProgressMetrics,
    StallWatch,
    read_progress,
)
from llmgw.agent.state import EngineRecord, StateStore
from llmgw.agent.supervisor import EngineProcess, ExitStatus, ProcessControl, describe_exit
from llmgw.agent.weights import Progress, WeightsCache
from llmgw.errors import EngineError
from llmgw.wire import (
    CPU_CLASS,
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


@dataclass
class RunnerDeps:
    """What every runner shares with the agent; one instance per agent."""

    supervisor: ProcessControl
    weights: WeightsCache
    ports: PortAllocator
    state: StateStore
    session: aiohttp.ClientSession
    host: str  # where engines listen
    on_change: Callable[[], None]  # a state changed: report soon
    peers: Callable[[str], list[str]]  # model -> peer agent URLs
    peer_token: Callable[[], str | None]
    stop_grace_s: float = 15.0
    # How often a starting engine is probed: every probe that finds it not
    # yet answering costs whatever of this interval is left when it comes up,
    # and that wait is the request's, held at the gateway (an on-demand cold
    # start spent 140-200 ms of it at 0.25 s, measured by bench/coldstart.py).
    # A refused connection or a 503 costs the engine nothing.
    poll_s: float = 0.02
    monitor_s: float = 1.0
    liveness: Liveness = field(default_factory=Liveness)
    # Holds engines to their memory budgets (agent.memguard); None: nothing
    # is enforced (fake process controls, whose pids are not real engines).
    memory: MemoryGuard | None = None
    # For copies from peers: verifies their servers against the CA that signs
    # node certificates (agent.nodecert) where the fleet runs TLS; None: ``session``.
    peer_session: aiohttp.ClientSession | None = None
    # The node's certificate for engines to listen with (agent.nodecert),
    # asked at each launch; None: engines are plain http.
    engine_tls: Callable[[], EngineTls | None] = lambda: None
    # Verifies engines that listen with TLS when the agent probes them.
    engine_probe_ssl: ssl.SSLContext | None = None


def _probe_host(host: str) -> str:
    # An engine bound to every interface is reached locally over loopback.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


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
        self.port: int | None = None
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
        self._failed_probes = FailedProbes(deps.liveness)
        self._stall = StallWatch(deps.liveness)
        self._task: asyncio.Task[None] | None = None
        self._weights_key: str | None = None  # held while starting or running

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
        self.tls = record.tls
        self.deps.ports.restore(self.replica_id, record.port)
        if record.failed:
            self._mark_failed(record.reason or "failed", record.exit_code, persist=False)
            return
        proc = None
        if record.pid is not None and record.birth is not None:
            proc = self.deps.supervisor.adopt(record.pid, record.birth)
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

    async def stop(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL) and forget the replica."""
        await self._cancel_task()
        if self.proc is not None:
            status = await self.deps.supervisor.stop(self.proc, self.deps.stop_grace_s)
            log.info("stopped %s: %s", self.replica_id, describe_exit(status.code))
        self.deps.state.remove(self.replica_id)
        self.deps.ports.release(self.replica_id)
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

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

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
        return ReplicaStatus(
            replica_id=self.replica_id,
            generation=self.generation,
            state=state,
            port=self.port,
            pid=self.proc.pid if self.proc else None,
            exit_code=self.exit_code,
            reason=reason,
            log_tail=self.deps.supervisor.log_tail(self.replica_id),
            download=download,
            started_at=self.started_at,
            ready_at=self.ready_at,
            dialect=self.dialect,
            tls=self.tls,
        )

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
                path = await deps.weights.ensure(
                    spec,
                    progress=self.progress,
                    peers=deps.peers(spec.name),
                    peer_token=deps.peer_token(),
                    session=deps.peer_session or deps.session,
                )
            finally:
                self.progress = None
        else:
            path = None
        self.port = deps.ports.allocate(self.replica_id)
        weights_bytes = await asyncio.to_thread(_size_of, path)
        gpus = sum(1 for d in self.devices if d.gpu_class != CPU_CLASS)
        budget = memory.need_mib(spec, weights_bytes, gpus)
        launch = self.adapter.build(
            LaunchContext(
                assignment=self.assignment,
                weights_path=path,
                host=deps.host,
                port=self.port,
                devices=self.devices,
                memory_budget_mib=budget,
                weights_bytes=weights_bytes,
                tls=deps.engine_tls(),
            )
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
        while True:
            status = self.deps.supervisor.poll(proc)
            if status.exited:
                await self._exited(status)
                return
            if await self._over_budget(proc):
                return
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
        while True:
            status = self.deps.supervisor.poll(proc)
            if status.exited:
                await self._exited(status)
                return
            if await self._over_budget(proc):
                return
            if time.monotonic() - last_rotate > LOG_ROTATE_EVERY_S:
                await asyncio.to_thread(self.deps.supervisor.rotate_if_large, self.replica_id)
                last_rotate = time.monotonic()
            if self.liveness_path is not None and time.monotonic() >= next_probe:
                if await self._hung(proc, self.liveness_path):
                    return
                # An engine that does not answer is the probe's to judge;
                # scraping it as well would only time out a second time.
                metrics = None if self._failed_probes.failing else self.metrics
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
        failed = self._failed_probes
        began, began_wall = time.monotonic(), time.time()
        error = await self._probe(path, self.deps.liveness.timeout_s)
        now = time.monotonic()
        if error is None:
            if failed.passed():
                log.info("replica %s answers %s again", self.replica_id, path)
                self._set(self.state, None, notify=True)
            return False
        first = not failed.failing
        # The engine has not answered since this probe was sent: the window
        # starts there, not when the probe gave up.
        failed.failed(error, began, began_wall)
        if not failed.hung(now):
            if first:
                log.warning("replica %s: %s probe failed: %s", self.replica_id, path, error)
            # Still routed to: one slow answer is not a hung engine. The reason
            # shows in reports (and `llmgw ctl replicas`) while it lasts.
            self._set(self.state, failed.failing_reason(path), notify=first)
            return False
        await self._kill_and_fail(proc, failed.hung_reason(path, now))
        return True

    async def _stalled(self, proc: EngineProcess, metrics: ProgressMetrics) -> bool:
        """Scrape a serving engine's metrics; kill and fail it once it has stalled long enough.

        True when the replica failed (stalled, or its process turned out to be gone).
        """
        stall = self._stall
        began, began_wall = time.monotonic(), time.time()
        try:
            values = await self._scrape(metrics)
        except (MetricsError, TimeoutError, aiohttp.ClientError, OSError) as exc:
            # Not a stall: the engine may just be between restarts of its
            # metrics, and one that stopped answering is the probe's to catch.
            # The still run is kept: no scrape says the counters moved.
            log.debug("replica %s: metrics %s: %s", self.replica_id, metrics.path, exc)
            return False
        was_stalling = stall.stalling
        running, counters = values
        stall.observe(running, counters, began, began_wall)
        now = time.monotonic()
        if not stall.stalling:
            if was_stalling:
                log.info("replica %s makes progress again", self.replica_id)
                self._set(self.state, None, notify=True)
            return False
        if not stall.stalled(now):
            if not was_stalling:
                log.warning("replica %s: %s", self.replica_id, stall.stalling_reason())
            self._set(self.state, stall.stalling_reason(), notify=not was_stalling)
            return False
        await self._kill_and_fail(proc, stall.stalled_reason(now))
        return True

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

    async def _scrape(self, metrics: ProgressMetrics) -> tuple[float, tuple[float, ...]]:
        url = self._engine_url(metrics.path)
        timeout = aiohttp.ClientTimeout(total=self.deps.liveness.timeout_s)
        async with self.deps.session.get(
            url, timeout=timeout, headers=self._engine_auth(), ssl=self._engine_ssl()
        ) as resp:
            if resp.status != 200:
                raise MetricsError(f"HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    raise MetricsError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
        return read_progress(body.decode("utf-8", errors="replace"), metrics)

    def _engine_auth(self) -> dict[str, str] | None:
        """The replica's engine key as a bearer token: sent on every probe, since
        engines differ in what they guard (llama_cpp.server's /v1/models, the
        readiness path, needs it; vLLM's /health does not)."""
        key = self.assignment.engine_key
        return {"Authorization": f"Bearer {key}"} if key else None

    def _engine_url(self, path: str) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_url_host(_probe_host(self.deps.host))}:{self.port}{path}"

    def _engine_ssl(self) -> ssl.SSLContext | bool:
        """How a probe verifies an engine that listens with TLS (True: aiohttp's default)."""
        if self.tls and self.deps.engine_probe_ssl is not None:
            return self.deps.engine_probe_ssl
        return True

    async def _probe(self, path: str, timeout_s: float) -> str | None:
        """GET ``path`` on the engine: None when it answers 200, else what went wrong."""
        url = self._engine_url(path)
        try:
            async with self.deps.session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s), headers=self._engine_auth(),
                ssl=self._engine_ssl(),
            ) as resp:
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return str(exc) or type(exc).__name__

    def _hold_memory(self, budget_mib: int) -> None:
        """Hold the engine to ``budget_mib`` (agent.memguard) from now on."""
        spec = self.assignment.model
        self.memory = EngineMemory(self.deps.memory, budget_mib, memory.advice(spec, budget_mib))
        if self.proc is not None:
            try:
                self.memory.attach(self.replica_id, self.proc.pid)
            except OSError as exc:  # e.g. the engine exited at once
                log.warning("replica %s: memory watch: %s", self.replica_id, exc)

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
        tail = self.deps.supervisor.log_tail(self.replica_id, REASON_LINES)
        return f"; last output: {' | '.join(tail)}" if tail else ""

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


def _size_of(path: str | None) -> int | None:
    """Bytes of a weights file, or of every file under a weights directory."""
    if path is None:
        return None
    try:
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(path)
            for name in names
        )
    except OSError:
        return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
