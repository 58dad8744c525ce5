"""Simulated engines inside the fleet's own process, behind the agent's ProcessControl seam.

A fleet of hundreds of nodes cannot start one Python process per replica on
a 2-core machine (each costs ~40 MB and a second of imports); a
:class:`~llmgw.sim.engine.SimEngine` costs one aiohttp server and one task.
:class:`InProcessEngines` implements the agent's
:class:`~llmgw.agent.supervisor.ProcessControl` so the agent runs unchanged:
it builds the same argv (``python -m llmgw.sim.engine --host ... --port ...``),
hands it to ``spawn``, polls ``/health`` over real HTTP, and routes to a real
port. Only the last step, turning argv into a process, differs: the argv is
parsed and the engine started on the running loop.

What cannot be the same: an in-process engine dies with the fleet process, so
there is nothing to adopt after a restart (``adopt`` returns None and the
replica is reported failed, as if its process had vanished); and "exit codes"
are the engine's own verdict (1 when it failed at start, 0 when stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
from collections import deque
from dataclasses import dataclass

from llmgw.agent.engines.base import EngineLaunch
from llmgw.agent.supervisor import RUNNING, EngineProcess, ExitStatus
from llmgw.engine_env import ENGINE_KEY_ENV
from llmgw.errors import EngineError, ValidationError
from llmgw.sim.core import check_params
from llmgw.sim.engine import SimEngine
from llmgw.sim.process import SIM_MODULE, argv_parser, parse_params, server_tls
from llmgw.wire import EngineKind

TAIL_LINES = 20


@dataclass
class RunningEngine:
    """What ``EngineProcess.handle`` holds for an in-process engine."""

    replica_id: str
    engine: SimEngine
    starting: asyncio.Task[int]
    log: deque[str]


async def _start(
    engine: SimEngine, host: str, port: int, log: deque[str], tls: ssl.SSLContext | None
) -> int:
    try:
        bound = await engine.start(host, port, tls)
    except OSError as exc:
        log.append(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
        raise
    log.append(f"sim engine {engine.model} listening on {engine.url}")
    return bound


def parse_launch(launch: EngineLaunch) -> argparse.Namespace:
    """A sim engine launch's arguments (llmgw.sim.process's flags); EngineError otherwise."""
    argv = launch.argv
    if SIM_MODULE not in argv:
        raise EngineError(
            f"the in-process fleet runs only sim engines; got {' '.join(argv[:3])} ..."
        )
    rest = argv[argv.index(SIM_MODULE) + 1 :]
    try:
        args, unknown = argv_parser(exit_on_error=False).parse_known_args(rest)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise EngineError(f"cannot read the sim engine's arguments: {exc}") from None
    if unknown:
        raise EngineError(f"the sim engine takes no arguments {unknown}")
    if args.count != 1:
        raise EngineError("an in-process sim engine is one engine (--count 1)")
    return args


class InProcessEngines:
    """ProcessControl for sim engines on the running event loop; one per fleet.

    Shared by every agent of the fleet: replica ids are unique fleet-wide, and
    one registry lets the fleet list (and stop) every engine it runs.
    """

    def __init__(self) -> None:
        self.running: dict[str, RunningEngine] = {}
        self._pid = os.getpid()

    def engines(self) -> list[SimEngine]:
        return [r.engine for r in self.running.values()]

    def spawn(self, replica_id: str, launch: EngineLaunch) -> EngineProcess:
        args = parse_launch(launch)
        try:
            params = parse_params(args.params_json)
            check_params(params)
        except ValidationError as exc:
            raise EngineError(f"bad sim parameters: {exc}") from None
        try:
            tls = server_tls(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
        except (OSError, ssl.SSLError) as exc:
            raise EngineError(f"the sim engine cannot listen with TLS: {exc}") from None
        host, port = str(args.host), int(args.port)
        # The key, as the engine's own process reads it (llmgw.sim.process).
        key = launch.env.get(ENGINE_KEY_ENV[EngineKind.SIM]) or None
        engine = SimEngine(str(args.model), params, api_key=key)
        log: deque[str] = deque(maxlen=TAIL_LINES)
        # spawn is synchronous in the seam; the engine binds its port in a
        # task, and a port it cannot bind shows as an exit on the next poll.
        starting = asyncio.get_running_loop().create_task(
            _start(engine, host, port, log, tls), name=f"sim-engine-{replica_id}"
        )
        entry = RunningEngine(replica_id, engine, starting, log)
        self.running[replica_id] = entry
        # The agent records pid and start time to find a process again; the
        # fleet's own pid is the honest answer, and adopt() refuses it.
        return EngineProcess(pid=self._pid, birth=f"sim:{replica_id}", handle=entry)

    def adopt(self, pid: int, birth: str) -> EngineProcess | None:
        return None  # an in-process engine never outlives the process that ran it

    def find(self, replica_id: str) -> EngineProcess | None:
        return None  # nor can one be left behind unrecorded

    def poll(self, proc: EngineProcess) -> ExitStatus:
        entry = self._entry(proc)
        starting = entry.starting
        if starting.done() and (starting.cancelled() or starting.exception() is not None):
            return ExitStatus(exited=True, code=1)
        state = entry.engine.state
        if state == "failed":
            return ExitStatus(exited=True, code=1)
        if state == "stopped":
            return ExitStatus(exited=True, code=0)
        return RUNNING

    async def stop(self, proc: EngineProcess, grace_s: float) -> ExitStatus:
        entry = self._entry(proc)
        failed = self.poll(proc)
        if not entry.starting.done():
            entry.starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await entry.starting
        await entry.engine.stop()
        if self.running.get(entry.replica_id) is entry:
            del self.running[entry.replica_id]
        return failed if failed.exited else ExitStatus(exited=True, code=0)

    def log_tail(
        self, replica_id: str, lines: int = TAIL_LINES, secret: str | None = None
    ) -> list[str]:
        entry = self.running.get(replica_id)
        if entry is None:
            return []
        out = list(entry.log)
        if entry.engine.state == "failed":
            out.append(f"sim engine {entry.engine.model}: failed at start (fault fail_at_start)")
        elif entry.engine.state == "hung":
            out.append(f"sim engine {entry.engine.model}: hangs now (hang_after_s)")
        elif entry.engine.stalled:
            out.append(f"sim engine {entry.engine.model}: stalls now (stall_after_s)")
        return out[-lines:]

    def rotate_if_large(self, replica_id: str) -> None:
        return None  # the log is a bounded deque

    async def stop_all(self) -> None:
        """Stop every engine still running (the fleet's last step)."""
        entries = list(self.running.values())
        self.running.clear()
        for entry in entries:
            entry.starting.cancel()
        # Awaited so that a start that failed (a taken port) is not left as
        # an exception nobody retrieved.
        await asyncio.gather(*(e.starting for e in entries), return_exceptions=True)
        await asyncio.gather(*(e.engine.stop() for e in entries), return_exceptions=True)

    @staticmethod
    def _entry(proc: EngineProcess) -> RunningEngine:
        if not isinstance(proc.handle, RunningEngine):
            raise EngineError(f"process {proc.pid} was not started by the in-process fleet")
        return proc.handle
