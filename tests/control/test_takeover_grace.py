"""A new leader counts a node's silence from its own takeover, not from the store's last_seen.

Found by the chaos suite (bench/chaos.py, patroni_leader_kill): while no
instance leads, no agent can report, and agents back off; the new leader
then read last_seen values older than the unreachable grace and called
every node unreachable at once, so every replica left routing and every
model was short until the backed-off reports came in. An outage longer
than the replacement grace would have replaced every replica of the fleet.

Two real instances on one PostgreSQL database; the leaderless outage is
the stored last_seen moved back (no clock can be moved across a store).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.control.standby_kit import Instance, Pair, stub_agent
from tests.waiting import eventually

from llmgw.agent.app import MAX_BACKOFF_S
from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.control.state import (
    REPLACE_AFTER_S,
    TAKEOVER_ALLOWANCE_S,
    UNREACHABLE_AFTER_S,
    NodeRecord,
)
from llmgw.wire import ModelSpec, NodeState, ReplicaState


async def test_a_node_silent_only_while_no_one_led_stays_reachable_and_keeps_its_replica(
    pair: Pair, tmp_path: Path,
) -> None:
    leader, standby, creds = pair
    await leader.cp.catalog.put([ModelSpec(name="m", engine="sim")])
    agent = stub_agent(leader.url, tmp_path / "n1", creds.join_token)
    run = asyncio.create_task(agent.run())
    runners = []
    try:
        try:
            def ready() -> list[str]:
                return [r.id for r in leader.cp.state.replicas.values()
                        if r.state == ReplicaState.READY]

            await eventually(lambda: bool(ready()), 15, "a ready replica on the leader")
            (replica_id,) = ready()
        finally:
            runners = list(agent.runners.values())
            # The node goes quiet with its replica running (the agent is only
            # away; its engines are not stopped).
            await agent.shutdown(stop_engines=False)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        await _takes_over_with_the_node_reachable(leader, standby, replica_id)
    finally:
        # Its engine, left running for an agent that never comes back.
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)


async def _takes_over_with_the_node_reachable(
    leader: Instance, standby: Instance, replica_id: str
) -> None:
    await leader.cp.agents.flush_heartbeats()
    # Its last report reached the store longer ago than the replacement
    # grace: that long without a leader (a store failover, say).
    await standby.store.touch_nodes({"n1": time.time() - REPLACE_AFTER_S - 30})
    await leader.stop()
    await eventually(lambda: standby.cp.is_leader, 10, "the standby to take over")
    took_over = time.time()
    # A few reconcile passes as leader: each would have called the node unreachable.
    passes = standby.runtime.passes
    await eventually(lambda: standby.runtime.passes >= passes + 4, 10,
                     "four reconcile passes on the new leader")

    now = time.time()
    node = standby.cp.state.nodes["n1"]
    assert node.state(now) is NodeState.READY
    replicas = list(standby.cp.state.replicas.values())
    assert [(r.id, r.state) for r in replicas] == [(replica_id, ReplicaState.READY)]
    assert standby.cp.state.routable(replicas[0], now)
    summary = fleet_summary(standby.cp.state, now, StoreStatus(members=[]))
    assert summary.nodes.unreachable == 0 and summary.models.short == 0
    # An agent may be waiting out its longest retry when the new leader
    # starts: silent for the grace after the takeover, it is still reachable...
    backed_off = took_over + UNREACHABLE_AFTER_S + 1
    assert node.state(backed_off) is NodeState.READY
    assert standby.cp.state.routable(replicas[0], backed_off)
    # ... and silent for that retry as well, it is unreachable.
    later = took_over + UNREACHABLE_AFTER_S + TAKEOVER_ALLOWANCE_S + 1
    assert node.state(later) is NodeState.UNREACHABLE
    assert not standby.cp.state.routable(replicas[0], later)


def test_the_takeover_allowance_covers_an_agents_longest_retry() -> None:
    # The allowance is the agent's backoff ceiling: a node whose agent failed
    # to reach the old leader for a while reports within it once one leads.
    assert TAKEOVER_ALLOWANCE_S >= MAX_BACKOFF_S


def test_a_node_heard_after_the_takeover_gets_the_plain_grace() -> None:
    took_over = 1_000.0
    node = NodeRecord(name="n1", registered_at=0.0, last_seen=took_over - 500)
    node.listening_since = took_over
    assert node.reachable_until() == took_over + TAKEOVER_ALLOWANCE_S + UNREACHABLE_AFTER_S
    assert node.silent_for(took_over + 10) == 10 - TAKEOVER_ALLOWANCE_S
    # Its first report to this instance: from then on the allowance is spent.
    node.last_seen = took_over + 5
    assert node.state(took_over + 5 + UNREACHABLE_AFTER_S - 1) is NodeState.READY
    assert node.state(took_over + 5 + UNREACHABLE_AFTER_S + 1) is NodeState.UNREACHABLE
    assert node.reachable_until() == took_over + 5 + UNREACHABLE_AFTER_S
