"""Two control-plane instances on one PostgreSQL database, in this process.

Shared by the tests of standbys (tests/control/test_standby.py) and of the
clients that must find the leader among several URLs (``llmgw ctl``,
``llmgw doctor``, ``llmgw sim fleet``). Each instance is what ``llmgw serve``
runs: a ControlPlane, its runtime (leader election, reconciler) and the
control-plane app on a real loopback port.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tests.agent.fakes import StubAdapter
from tests.agent.helpers import cpu_slot
from tests.control.planekit import opened_plane
from tests.servers import free_port, serve_asgi

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.store.repo import Store
from llmgw.wire import EngineKind, NodeInventory

Pair = tuple["Instance", "Instance", NewCredentials]


@dataclass
class Instance:
    """One ``llmgw serve`` worth of control plane, in this process."""

    url: str
    store: Store
    cp: ControlPlane
    runtime: ControlPlaneRuntime
    stop: Callable[[], Awaitable[None]]


@contextlib.asynccontextmanager
async def instance(database_url: str) -> AsyncIterator[Instance]:
    stack = contextlib.AsyncExitStack()
    try:
        cp, _ = await stack.enter_async_context(opened_plane(database_url))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        await stack.enter_async_context(serve_asgi(create_app(cp), port, graceful_s=0.2))
        runtime = ControlPlaneRuntime(cp, reconcile_interval_s=0.3, advertise_url=url)
        await runtime.start()
        # Stopped first, as `serve` stops: the runtime, the server, then the store
        # (which lets go of the leader's lock). stop() may come early; it runs once.
        stack.push_async_callback(runtime.stop)
        yield Instance(url, cp.store, cp, runtime, stack.aclose)
    finally:
        await stack.aclose()


@contextlib.asynccontextmanager
async def leader_and_standby(database_url: str) -> AsyncIterator[Pair]:
    """(leader, standby, credentials) on one fresh database; the first started leads."""
    async with opened_plane(database_url) as (_, creds):
        pass
    async with instance(database_url) as leader, instance(database_url) as standby:
        assert leader.cp.is_leader and not standby.cp.is_leader
        yield leader, standby, creds


def inventory() -> NodeInventory:
    return NodeInventory(hostname="n1", devices=[cpu_slot(0, "n1")])


def stub_agent(control_plane: str, data_dir: Path, join_token: str | None) -> Agent:
    """Node n1's agent with one CPU slot, its engines stubs that are ready at once."""
    return Agent(
        AgentConfig(control_plane=control_plane, data_dir=data_dir, name="n1",
                    join_token=join_token, stop_grace_s=2.0),
        inventory_provider=inventory, adapters={EngineKind.SIM: StubAdapter()},
    )
