"""A simulated fleet: many nodes, each a real agent with fake GPUs, in one process.

Scale tests and demos need hundreds of nodes talking to a real control plane
over real HTTP, on a machine with two cores and no GPU. Each node here is the
real :class:`~llmgw.agent.app.Agent` (registration, reports, convergence,
health checks, all unchanged) with two things swapped through its seams:

- its inventory comes from the fleet spec (:mod:`llmgw.sim.inventory`);
- its engines run in this process (:class:`~llmgw.sim.inprocess.InProcessEngines`)
  unless ``engines="subprocess"``, where the agent's own supervisor starts
  ``python -m llmgw.sim.engine`` processes as on a real node.

Load on the control plane is what a real fleet of that size makes: agents
share one HTTP session (one connection pool, not hundreds), and their first
reports are spread over a report interval so 200+ nodes never report in
lockstep (each keeps its own phase afterwards).

Entry points: :func:`start_fleet` (``llmgw up --sim``, ``llmgw sim fleet``,
tests) and :func:`load_fleet_spec` (re-exported here) for callers that apply
the spec's models themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.engines.sim import SimAdapter
from llmgw.agent.ports import PortAllocator
from llmgw.agent.supervisor import ProcessControl, Supervisor
from llmgw.config import ensure_data_dir
from llmgw.cpclient import ControlPlaneCaller
from llmgw.errors import ConfigError, ControlPlaneUnavailable
from llmgw.failover import parse_control_plane_urls
from llmgw.sim.engine import SimEngine
from llmgw.sim.fleetspec import FleetSpec, load_fleet_spec
from llmgw.sim.inprocess import InProcessEngines
from llmgw.sim.inventory import SimNode, fleet_nodes
from llmgw.wire import EngineKind, ModelSpec, NodeInventory

__all__ = ["Fleet", "FleetSpec", "apply_models", "load_fleet_spec", "start_fleet"]

log = logging.getLogger("llmgw.sim.fleet")

EngineMode = Literal["inprocess", "subprocess"]
ADMIN_TOKEN_ENV = "LLMGW_ADMIN_TOKEN"
APPLY_PATH = "/admin/v1/apply"
# The control plane's default report interval; first reports are spread over
# it. A small fleet gets a shorter spread so that it is up at once.
REPORT_SPREAD_S = 5.0
SPREAD_PER_NODE_S = 0.025
# In-process engines stop in milliseconds; a subprocess sim engine exits on
# SIGTERM well within this.
STOP_GRACE_S = 3.0


@dataclass(eq=False)
class Fleet:
    """The running fleet: its agents, their tasks and (in-process) their engines."""

    spec: FleetSpec
    nodes: list[SimNode]
    agents: list[Agent]
    engines: InProcessEngines | None
    # The agents' one connection pool, closed with the fleet.
    session: aiohttp.ClientSession
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def _launch(self, spread_s: float) -> None:
        rng = random.Random()
        for agent in self.agents:
            task = asyncio.create_task(
                _run_agent(agent, rng.uniform(0.0, spread_s)), name=f"sim-agent-{agent.config.name}"
            )
            task.add_done_callback(_log_agent_end)
            self._tasks.append(task)

    # -- views ---------------------------------------------------------------------

    def registered(self) -> int:
        """Nodes whose agent has registered and had a report answered."""
        return sum(1 for a in self.agents if a.identity is not None and a.reports_sent > 0)

    def failed_agents(self) -> dict[str, str]:
        """Agents whose loop ended with an error (e.g. a refused join token)."""
        out = {}
        for agent, task in zip(self.agents, self._tasks, strict=True):
            if task.done() and not task.cancelled() and task.exception() is not None:
                out[agent.config.name] = str(task.exception())
        return out

    def sim_engines(self) -> list[SimEngine]:
        """The in-process engines running now (empty with subprocess engines)."""
        return self.engines.engines() if self.engines is not None else []

    def replica_states(self) -> dict[str, str]:
        """Replica id -> state as the agents see them."""
        return {
            rid: runner.status().state.value
            for agent in self.agents
            for rid, runner in agent.runners.items()
        }

    async def wait_registered(self, timeout_s: float) -> float:
        """Seconds until every node reported once; ConfigError on a dead agent or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            failed = self.failed_agents()
            if failed:
                name, why = next(iter(failed.items()))
                raise ConfigError(f"{len(failed)} simulated node(s) stopped, e.g. {name}: {why}")
            if self.registered() == len(self.agents):
                return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"only {self.registered()} of {len(self.agents)} simulated nodes registered"
                    f" within {timeout_s:g} s"
                )
            await asyncio.sleep(0.1)

    # -- stopping ----------------------------------------------------------------

    async def shutdown(self, stop_engines: bool = True) -> None:
        """Stop every agent (and its engines); the fleet cannot be restarted."""
        await asyncio.gather(
            *(a.shutdown(stop_engines=stop_engines) for a in self.agents), return_exceptions=True
        )
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engines is not None:
            # In-process engines cannot outlive the process anyway; stop the
            # stragglers (e.g. ones a stopping agent had not reached) cleanly.
            await self.engines.stop_all()
        if not self.session.closed:
            await self.session.close()


async def _run_agent(agent: Agent, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await agent.run()


def _log_agent_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %s", task.get_name(), task.exception())


def _static(inventory: NodeInventory) -> Any:
    return lambda: inventory


def build_agents(
    nodes: Sequence[SimNode],
    control_plane_url: str,
    join_token: str | None,
    data_dir: Path,
    *,
    engines: InProcessEngines | None,
    session: aiohttp.ClientSession,
) -> list[Agent]:
    """One agent per node, with its own data dir under ``data_dir``."""
    adapter = SimAdapter()
    # One allocator for every agent of the process: an in-process engine binds
    # its port a moment after the allocator's probe, so two agents probing on
    # their own could hand out the same free port.
    ports = PortAllocator("127.0.0.1")
    agents = []
    for node in nodes:
        node_dir = data_dir / node.name
        if engines is not None:
            # Records of in-process engines of a previous run point at nothing.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(node_dir / "engines.json")
        supervisor: ProcessControl = (
            engines if engines is not None else Supervisor(node_dir / "logs")
        )
        agent = Agent(
            AgentConfig(
                control_plane=control_plane_url,
                data_dir=node_dir,
                name=node.name,
                join_token=join_token,
                fabrics=list(node.fabrics),
                address="127.0.0.1",
                cpu_slots=node.cpu_slots,
                serve_weights=False,
                stop_grace_s=STOP_GRACE_S,
            ),
            inventory_provider=_static(node.inventory),
            adapters={EngineKind.SIM: adapter},
            supervisor=supervisor,
            session=session,
        )
        agent.ports = ports
        agents.append(agent)
    return agents


async def apply_models(
    control_plane_url: str,
    admin_token: str,
    models: Sequence[ModelSpec],
    session: aiohttp.ClientSession | None = None,
) -> dict[str, Any]:
    """Apply catalog entries through the admin API (``POST /admin/v1/apply``).

    ``control_plane_url`` may list several instances, comma-separated: the
    apply goes to the leader (llmgw.failover), as a standby refuses it.
    """
    body = orjson.dumps({"models": [m.model_dump(mode="json") for m in models]})
    headers = {"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"}
    own = session is None
    client = session or aiohttp.ClientSession()
    try:
        answer = await ControlPlaneCaller(control_plane_url).call(
            client, "POST", APPLY_PATH, data=body, headers=headers,
            credential="admin token", refused="the fleet's models",
            # A one-off call with no backoff around it: no instance twice.
            limits=aiohttp.ClientTimeout(total=30), once_each=True,
        )
    except ControlPlaneUnavailable as exc:
        raise ConfigError(f"cannot apply the fleet's models: {exc}") from None
    finally:
        if own:
            await client.close()
    result: dict[str, Any] = orjson.loads(answer.body)
    return result


async def start_fleet(
    spec: str | Path | FleetSpec,
    control_plane_url: str,
    join_token: str | None,
    data_dir: str | Path,
    *,
    engines: EngineMode = "inprocess",
    admin_token: str | None = None,
    apply: bool = True,
    spread_s: float | None = None,
) -> Fleet:
    """Start the fleet described by ``spec`` against the control plane; returns at once.

    ``control_plane_url`` may list several instances (leader and standbys),
    comma-separated; the agents and the apply follow the leader among them.

    The spec's models are applied first through the admin API when ``apply``
    is true and an admin token is at hand (``admin_token`` or the
    ``LLMGW_ADMIN_TOKEN`` environment variable); a caller that applies them
    itself (``llmgw up``, in-process) passes ``apply=False``. Nodes then
    register in the background: ``await fleet.wait_registered(t)`` waits for them.
    """
    if engines not in ("inprocess", "subprocess"):
        raise ConfigError(f"engines must be inprocess or subprocess, not {engines!r}")
    # A bad URL is one error here, not one per agent after the fleet started.
    control_plane_url = ",".join(parse_control_plane_urls(control_plane_url))
    fleet_spec = spec if isinstance(spec, FleetSpec) else load_fleet_spec(spec)
    root = ensure_data_dir(Path(data_dir))
    session = aiohttp.ClientSession()
    try:
        if fleet_spec.models and apply:
            token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
            if token:
                await apply_models(control_plane_url, token, fleet_spec.models, session)
            else:
                log.warning(
                    "the fleet spec's %d model(s) were not applied: no admin token"
                    " (set %s or pass one)",
                    len(fleet_spec.models),
                    ADMIN_TOKEN_ENV,
                )
        nodes = list(fleet_nodes(fleet_spec))
        runner = InProcessEngines() if engines == "inprocess" else None
        agents = build_agents(
            nodes, control_plane_url, join_token, root, engines=runner, session=session
        )
        for agent in agents:
            await agent.start()
    except BaseException:
        await session.close()
        raise
    fleet = Fleet(fleet_spec, nodes, agents, runner, session)
    if spread_s is None:
        spread_s = min(REPORT_SPREAD_S, SPREAD_PER_NODE_S * len(nodes))
    fleet._launch(max(0.0, spread_s))
    log.info("simulated fleet: %d nodes starting (%s engines)", len(nodes), engines)
    return fleet
