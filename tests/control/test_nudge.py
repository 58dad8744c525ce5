"""A placement reaches its agent at once, not at the agent's next report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.servers import serve_asgi

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.app import create_app
from llmgw.control.nudge import assignment_signature, changed_nodes
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.service import ControlPlane
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.wire import ModelSpec, ReplicaState, ShardAssignment, SimParams


def test_signature_changes_name_the_nodes_affected() -> None:
    state = FleetState()
    state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0,
        shards=[ShardAssignment(node="a"), ShardAssignment(node="b", rank=1)],
    )
    before = assignment_signature(state)
    state.replicas["r1"].generation += 1
    state.replicas["r2"] = ReplicaRecord(id="r2", model="m", created_at=0.0,
                                         shards=[ShardAssignment(node="c")])
    assert changed_nodes(before, assignment_signature(state)) == {"a", "b", "c"}
    assert changed_nodes(before, before) == set()


async def test_a_new_replica_starts_long_before_the_next_report(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    runtime = ControlPlaneRuntime(cp, reconcile_interval_s=0.5)
    await runtime.start()
    agent: Agent | None = None
    try:
        async with serve_asgi(create_app(cp)) as url:
            agent = Agent(AgentConfig(
                control_plane=url, data_dir=tmp_path / "agent", name="n1",
                join_token=creds.join_token, cpu_slots=1,
                report_interval_s=60.0,  # the control plane's answer sets 5 s
            ))
            run = asyncio.create_task(agent.run())
            deadline = time.monotonic() + 20
            while "n1" not in cp.state.nodes or cp.state.nodes["n1"].agent_port is None:
                assert time.monotonic() < deadline and not run.done()
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # let the first exchange finish: the agent now waits

            asked = time.monotonic()
            await cp.catalog.put([ModelSpec(name="m", engine="sim",
                                           sim=SimParams(startup_s=0.0))])
            while not agent.runners:
                # Without the nudge the agent would hear of it at its next
                # report, ~5 s away (the interval the control plane sets).
                assert time.monotonic() - asked < 2.0, "the agent was not told"
                await asyncio.sleep(0.02)
            while not any(r.state == ReplicaState.READY for r in cp.state.replicas.values()):
                assert time.monotonic() - asked < 20, [
                    (r.state, r.reason) for r in cp.state.replicas.values()]
                await asyncio.sleep(0.05)
    finally:
        if agent is not None:
            await agent.shutdown(stop_engines=True)
        await runtime.stop()
        await store.close()
