"""One ready engine's LoRA adapters and sleep, kept as its assignment says.

The control plane decides which adapters a replica should have loaded and
whether it should sleep (control.adapters, control.sleep); the assignment
carries both, and changing them restarts nothing. This converges the engine
to them through its runtime routes, as vLLM names them:

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (vLLM mounts them with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which the agent sets only on
  engines behind their guard: under ``/v1`` they need the engine key too);
- ``POST /sleep?level=1`` and ``POST /wake_up`` (vLLM mounts them with
  ``VLLM_SERVER_DEV_MODE=1``, outside its API key's scope: only the guard,
  agent.engineguard, keeps the network off them).

llama-server takes adapters only when it starts (``--lora``) and applies
them per request: its replica is started with the adapters its assignment
lists then (agent.replicas), which stay loaded while it runs; one asked for
later is reported as not loadable there, so the control plane serves it
from replicas started after it. Once it is up, ``POST /lora-adapters`` sets
every adapter's default scale to 0: ``--lora-init-without-apply`` leaves
them at 1, and a request without a ``lora`` field runs with the defaults
(the gateway sends the field with every request; this covers the rest).

An adapter's weights are fetched and verified as a model's are
(agent.weights, the adapter's own catalog entry) and held in the cache while
it is loaded. A load the engine refuses is reported with its reason
(``ReplicaStatus.adapter_errors``) and not tried again on this engine for
``RETRY_AFTER_S``, so the control plane loads it elsewhere instead of the
agent hammering the engine with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import aiohttp

from llmgw import memory
from llmgw.agent.engineprobe import EngineEndpoint
from llmgw.agent.memguard import EngineMemory
from llmgw.agent.replicalaunch import fetch_weights
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.weights import Progress
from llmgw.sleepmode import sleeps_by_itself
from llmgw.wire import EngineDialect, ModelSpec, ReplicaAssignment, ReplicaStatus

log = logging.getLogger("llmgw.agent.loras")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
SLEEP_PATH = "/sleep?level=1"
WAKE_PATH = "/wake_up"
SCALES_PATH = "/lora-adapters"
# llama-server: tokenizing nothing needs the model, so it wakes the engine.
WAKE_BY_REQUEST = "/tokenize"
# A load can read an adapter of hundreds of MB; a wake copies the weights back.
CALL_TIMEOUT_S = 120.0
RETRY_AFTER_S = 60.0
_ALREADY = "already been loaded"
ADDED_AFTER_START = ("llama-server takes adapters only at its start, and this replica started"
                     " before the adapter was in the catalog: replicas started from now take it")

# Where an adapter's weights are on this node (None: it has none, the
# simulator's), fetched and verified; and the cache hold to release.
Fetch = Callable[[ModelSpec], Awaitable[tuple[str | None, str | None]]]
Release = Callable[[str], None]


class EngineControl:
    """What one engine has loaded and whether it sleeps, as the agent last made it."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.loaded: dict[str, str | None] = {}  # adapter -> its cache hold
        self.errors: dict[str, tuple[str, float]] = {}  # adapter -> (why, when)
        self.sleeping = False
        self.loads = 0
        self.unloads = 0
        # Set when its assignment changes (agent.replicaset): converge now.
        self.poke = asyncio.Event()
        self.weights_bytes: int | None = None  # the engine's, once launched
        # The adapters an engine that takes them only at its start (llama-server)
        # was started with; None: it loads and unloads them at runtime (vLLM).
        self.fixed: frozenset[str] | None = None
        self.defaults_zeroed = False  # its adapters' default scales set to 0

    def started_with(self, adapters: dict[str, str | None]) -> None:
        """The engine took these adapters at its start (name -> cache hold): they stay
        loaded while it runs, and no other joins them."""
        self.fixed = frozenset(adapters)
        self.loaded = dict(adapters)
        self.errors.clear()
        self.defaults_zeroed = not adapters

    def adopted(
        self, dialect: EngineDialect | None, specs: list[ModelSpec],
        hold: Callable[[ModelSpec], str | None],
    ) -> None:
        """An engine the agent before this one started: the adapters it took, held again."""
        started = dialect.lora_ids if dialect is not None else None
        if started is None:
            return
        by_name = {spec.name: spec for spec in specs}
        self.started_with({
            name: hold(by_name[name]) if name in by_name else None for name in started
        })

    def release_all(self, release: Release) -> None:
        """Let go of every adapter's weights: the engine is gone."""
        for hold in self.loaded.values():
            if hold is not None:
                release(hold)
        self.loaded.clear()

    def report(self, status: ReplicaStatus) -> ReplicaStatus:
        """``status`` with what this engine has loaded, refused, and whether it sleeps."""
        status.adapters = sorted(self.loaded)
        status.adapter_errors = self.reported_errors()
        status.sleeping = self.sleeping
        return status

    def reported_errors(self) -> dict[str, str]:
        return {name: why for name, (why, _) in self.errors.items()}

    async def converge(
        self, assignment: ReplicaAssignment, engine: EngineEndpoint, fetch: Fetch,
        release: Release,
    ) -> bool:
        """One step towards the assignment; True when anything changed."""
        if self.fixed is not None:
            if not self.defaults_zeroed:
                await self._zero_defaults(engine)
            slept = await self._follow_own_sleep(assignment, engine)
            return self._note_missing({spec.name for spec in assignment.adapters}) or slept
        if assignment.asleep and not self.sleeping:
            # Adapters stay loaded through a sleep (vLLM keeps its LoRA manager).
            return await self._call(engine, SLEEP_PATH, None, "sleep", asleep=True)
        if not assignment.asleep and self.sleeping:
            return await self._call(engine, WAKE_PATH, None, "wake", asleep=False)
        if self.sleeping:
            return False
        changed = False
        wanted = {spec.name: spec for spec in assignment.adapters}
        now = time.monotonic()
        for name, (_, at) in list(self.errors.items()):
            if now - at > RETRY_AFTER_S:
                del self.errors[name]
        # Unloads first: their slots are what the loads need.
        for name in [n for n in self.loaded if n not in wanted]:
            status, text = await engine.post(UNLOAD_PATH, {"lora_name": name}, CALL_TIMEOUT_S)
            if status == 200 or status == 404:  # 404: not loaded (an engine restarted)
                hold = self.loaded.pop(name)
                if hold is not None:
                    release(hold)
                self.unloads += status == 200
                changed = True
            else:
                log.warning("replica %s: unload of %s: HTTP %d %s", self.replica_id, name,
                            status, text)  # fmt: skip
        for name, spec in wanted.items():
            if name in self.loaded or name in self.errors:
                continue
            changed = await self._load(engine, spec, fetch, release) or changed
        return changed

    async def _follow_own_sleep(self, assignment: ReplicaAssignment,
                                engine: EngineEndpoint) -> bool:  # fmt: skip
        """llama-server sleeps by itself when idle (llmgw.sleepmode): told to sleep, report
        it asleep once it is; told to wake, wake it with a request that computes nothing."""
        if not sleeps_by_itself(assignment.model):
            return False
        if assignment.asleep and not self.sleeping:
            try:
                asleep = await engine.asleep(CALL_TIMEOUT_S)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("replica %s: sleep state: %s", self.replica_id, exc)
                return False
            self.sleeping = asleep is True
            return self.sleeping
        if not assignment.asleep and self.sleeping:
            # Any route that needs the model waits for it to be loaded again.
            return await self._call(engine, WAKE_BY_REQUEST, {"content": ""}, "wake",
                                    asleep=False)  # fmt: skip
        return False

    async def _zero_defaults(self, engine: EngineEndpoint) -> None:
        scales: list[dict[str, int | float]] = [
            {"id": number, "scale": 0.0} for number in range(len(self.fixed or ()))
        ]
        try:
            status, text = await engine.post(SCALES_PATH, scales, CALL_TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("replica %s: adapter scales: %s", self.replica_id, exc)
            return
        if status == 200:
            self.defaults_zeroed = True
        else:
            log.warning("replica %s: adapter scales: HTTP %d %s", self.replica_id, status, text)

    def _note_missing(self, wanted: set[str]) -> bool:
        """An engine with a fixed set: report each wanted adapter it was not started with."""
        fixed = self.fixed or frozenset()
        missing = wanted - fixed
        changed = False
        for name in missing - self.errors.keys():
            self.errors[name] = (ADDED_AFTER_START, time.monotonic())
            changed = True
        for name in self.errors.keys() - missing:
            del self.errors[name]
            changed = True
        return changed

    async def _load(
        self, engine: EngineEndpoint, spec: ModelSpec, fetch: Fetch, release: Release
    ) -> bool:
        name = spec.name
        try:
            path, hold = await fetch(spec)
        except Exception as exc:  # a download or a digest that did not match
            self.errors[name] = (f"weights: {exc}", time.monotonic())
            return True
        status, text = await engine.post(
            LOAD_PATH, {"lora_name": name, "lora_path": path or name}, CALL_TIMEOUT_S
        )
        if status == 200 or (status == 400 and _ALREADY in text):
            self.loaded[name] = hold
            self.loads += status == 200
            log.info("replica %s: adapter %s loaded", self.replica_id, name)
            return True
        if hold is not None:
            release(hold)
        self.errors[name] = (f"load refused: HTTP {status}: {text.strip()[:300]}",
                             time.monotonic())  # fmt: skip
        log.warning("replica %s: adapter %s: %s", self.replica_id, name, self.errors[name][0])
        return True

    async def _call(
        self, engine: EngineEndpoint, path: str, body: dict[str, str] | None, what: str,
        *, asleep: bool,
    ) -> bool:
        try:
            status, text = await engine.post(path, body, CALL_TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("replica %s: %s: %s", self.replica_id, what, exc)
            return False
        if status != 200:
            log.warning("replica %s: %s: HTTP %d %s", self.replica_id, what, status, text)
            return False
        self.sleeping = asleep
        log.info("replica %s: engine %s", self.replica_id, "asleep" if asleep else "awake")
        return True


async def start_adapters(
    deps: RunnerDeps, control: EngineControl, specs: list[ModelSpec], at_start: bool
) -> tuple[tuple[str, str], ...]:
    """The adapters an engine that takes them only at its start (``at_start``) is
    started with: ``specs`` fetched and held, as (name, weights path) in the engine's
    order; none for an engine that loads them at runtime.

    One whose weights cannot be had is left out and reported with why: the base
    and the other adapters serve without it.
    """
    if not at_start:
        return ()
    holds: dict[str, str | None] = {}
    paths: list[tuple[str, str]] = []
    failed: dict[str, str] = {}
    try:
        for spec in specs:
            hold = deps.weights.hold(spec)
            try:
                path = await fetch_weights(deps, spec, Progress())
            except Exception as exc:  # a download or a digest that did not match
                path, failed[spec.name] = None, f"weights: {exc}"
            if path is None:
                failed.setdefault(spec.name, "weights: none to start with")
                if hold is not None:
                    deps.weights.release(hold)
                continue
            holds[spec.name] = hold
            paths.append((spec.name, path))
    except BaseException:
        for hold in holds.values():
            if hold is not None:
                deps.weights.release(hold)
        raise
    control.started_with(holds)
    now = time.monotonic()
    control.errors.update({name: (why, now) for name, why in failed.items()})
    for name, why in failed.items():
        log.warning("replica %s: adapter %s left out: %s", control.replica_id, name, why)
    return tuple(paths)


class ControlledRunner(Protocol):
    """What of a replica's runner (agent.replicas) the control loop reads."""

    assignment: ReplicaAssignment
    control: EngineControl
    deps: RunnerDeps
    memory: EngineMemory | None

    def _endpoint(self) -> EngineEndpoint: ...


def sleeping_mib(spec: ModelSpec, weights_bytes: int | None) -> int:
    """Host RAM the engine's weights take while it sleeps (llama-server frees them)."""
    if spec.sim is not None:
        return spec.sim.weights_mib
    if sleeps_by_itself(spec):
        return 0
    return -(-(weights_bytes or 0) // memory.MIB)


@contextlib.asynccontextmanager
async def engine_control(runner: ControlledRunner, ready: bool) -> AsyncIterator[None]:
    """Keep the engine's adapters and sleep converged while the body runs (its watch)."""
    task = asyncio.create_task(_keep(runner)) if ready else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _keep(runner: ControlledRunner) -> None:
    deps, control = runner.deps, runner.control

    async def fetch(spec: ModelSpec) -> tuple[str | None, str | None]:
        hold = deps.weights.hold(spec)
        try:
            path = await fetch_weights(deps, spec, Progress())
        except BaseException:
            if hold is not None:
                deps.weights.release(hold)
            raise
        return path, hold

    while True:
        control.poke.clear()
        wanted = runner.assignment
        try:
            changed = await control.converge(wanted, runner._endpoint(), fetch,
                                             deps.weights.release)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("replica %s: engine control: %s", control.replica_id, exc)
            changed = False
        if changed:
            if runner.memory is not None:
                runner.memory.hold_asleep(
                    sleeping_mib(wanted.model, control.weights_bytes) if control.sleeping else 0
                )
            deps.on_change()  # the control plane hears of it with the next report, now
        if changed and not control.poke.is_set():
            continue  # more to do (one change per step)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deps.monitor_s):
                await control.poke.wait()
