"""A placement reaches its agent at once, not at the agent's next report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.control.planekit import running, served_plane
from tests.waiting import eventually

from llmgw.agent.app import Agent, AgentConfig
from llmgw.control.nudge import AssignmentWatch
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import ModelSpec, ReplicaState, ShardAssignment, SimParams


def test_the_watch_names_the_nodes_whose_assignments_changed() -> None:
    state = FleetState()
    state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0,
        shards=[ShardAssignment(node="a"), ShardAssignment(node="b", rank=1)],
    )
    state.replicas["r3"] = ReplicaRecord(id="r3", model="m", created_at=0.0,
                                         shards=[ShardAssignment(node="d")])
    state.replicas["r4"] = ReplicaRecord(id="r4", model="m", created_at=0.0,
                                         shards=[ShardAssignment(node="e")])
    watch = AssignmentWatch(state)
    assert watch.changed(state) == set()
    state.replicas["r1"].generation += 1
    state.replicas["r2"] = ReplicaRecord(id="r2", model="m", created_at=0.0,
                                         shards=[ShardAssignment(node="c")])
    del state.replicas["r3"]
    assert watch.changed(state) == {"a", "b", "c", "d"}
    assert watch.changed(state) == set()
    # Draining is an instruction too (moved in place, the table's version unmoved).
    state.replicas["r4"].move_to(ReplicaState.READY)
    assert watch.changed(state) == set()
    state.replicas["r4"].move_to(ReplicaState.DRAINING)
    assert watch.changed(state) == {"e"}
    # A record replaced under its id, the same item: only the nodes it left or joined.
    state.replicas["r1"] = ReplicaRecord(
        id="r1", model="m", created_at=0.0, generation=2,
        shards=[ShardAssignment(node="a"), ShardAssignment(node="f", rank=1)],
    )
    assert watch.changed(state) == {"b", "f"}


async def test_a_new_replica_starts_long_before_the_next_report(tmp_path: Path) -> None:
    async with served_plane(tmp_path) as (cp, creds, url), running(cp, reconcile_interval_s=0.5):
        agent = Agent(AgentConfig(
            control_plane=url, data_dir=tmp_path / "agent", name="n1",
            join_token=creds.join_token, cpu_slots=1,
            report_interval_s=60.0,  # the control plane's answer sets 5 s
        ))
        try:
            run = asyncio.create_task(agent.run())

            def listening() -> bool:
                assert not run.done()
                node = cp.state.nodes.get("n1")
                return node is not None and node.agent_port is not None

            await eventually(listening, 20, "the agent to register and report its port")
            # The first exchange over: the agent now waits out its interval.
            await eventually(lambda: agent.reports_sent >= 1, 5, "the first report's answer")

            asked = time.monotonic()
            await cp.catalog.put([ModelSpec(name="m", engine="sim",
                                           sim=SimParams(startup_s=0.0))])
            # Without the nudge the agent would hear of it at its next
            # report, ~5 s away (the interval the control plane sets).
            await eventually(lambda: agent.runners, 2.0 - (time.monotonic() - asked),
                             "the agent to be told", every_s=0.02)
            await eventually(
                lambda: any(r.state == ReplicaState.READY for r in cp.state.replicas.values()),
                20 - (time.monotonic() - asked), "the replica to be ready",
                note=lambda: [(r.state, r.reason) for r in cp.state.replicas.values()])
        finally:
            await agent.shutdown(stop_engines=True)
