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
from tests.servers import free_port, serve_asgi

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.app import create_app
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.service import ControlPlane, NewCredentials
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
    store = await Store.open(database_url)
    cp = ControlPlane(store)
    await cp.load()
    await cp.ensure_credentials()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runtime = ControlPlaneRuntime(cp, reconcile_interval_s=0.3, advertise_url=url)
    await runtime.start()
    stopped = False
    server = serve_asgi(create_app(cp), port, graceful_s=0.2)
    await server.__aenter__()

    async def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            await runtime.stop()
            await server.__aexit__(None, None, None)
            await store.close()

    try:
        yield Instance(url, store, cp, runtime, stop)
    finally:
        await stop()


@contextlib.asynccontextmanager
async def leader_and_standby(database_url: str) -> AsyncIterator[Pair]:
    """(leader, standby, credentials) on one fresh database; the first started leads."""
    store = await Store.open(database_url)
    creds = await ControlPlane(store).ensure_credentials()
    await store.close()
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
