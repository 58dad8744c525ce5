"""Every write of the control plane is fenced: a leader deposed mid-write is refused.

"Deposed mid-write": another instance takes the next epoch (as a new leader
does when it wins) after this one checked that it leads and before its
write commits. The write must change nothing in the store, and the
instance must stop acting as leader at once. On PostgreSQL, where a
deposed leader really can still be running (its lock connection broke, it
has not noticed yet).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from tests.control.standby_kit import leader_and_standby
from tests.waiting import eventually

from llmgw.control.leader import Leadership
from llmgw.control.plane import ControlPlane
from llmgw.control.reconciler import Reconciler
from llmgw.control.rows import model_row, replica_row
from llmgw.control.state import ReplicaRecord
from llmgw.control.store import schema
from llmgw.control.store.repo import Store
from llmgw.errors import NotLeaderError
from llmgw.wire import (
    AgentRegistration,
    AgentReport,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaState,
    ShardAssignment,
    UsageRecord,
)

KEY = "llmgw-agent-key-" + "k" * 43


@dataclass
class Fleet:
    cp: ControlPlane
    rival: Store  # another instance's connection to the same database
    join_token: str
    key_id: str
    stale: list[bool]


@contextlib.asynccontextmanager
async def leading(url: str) -> AsyncIterator[Fleet]:
    """A leader (epoch taken as an election does) with something of each kind to change."""
    store = await Store.open(url)
    rival = await Store.open(url)
    stale: list[bool] = []
    leadership = Leadership(is_leader=True, epoch=await store.bump_epoch(),
                            on_stale=lambda: stale.append(True))
    cp = ControlPlane(store, leadership=leadership)
    try:
        await cp.load()
        creds = await cp.ensure_credentials(first_api_key=False)
        assert creds.join_token
        await cp.catalog.put([ModelSpec(name="m", engine="sim"),
                             ModelSpec(name="parked", engine="sim")])
        cp.state.models["parked"].parked = True
        await cp.writes.upsert_models([model_row(cp.state.models["parked"])])
        await cp.nodes.register(AgentRegistration(node="n1", join_token=creds.join_token,
                                            agent_key=KEY))
        replica = ReplicaRecord(id="r1", model="m", created_at=time.time(),
                                shards=[ShardAssignment(node="n1", device_numbers=[0])],
                                state=ReplicaState.READY, port=30001)
        cp.state.replicas["r1"] = replica
        await cp.writes.write_replicas([replica_row(replica)])
        info, _ = await cp.keys.create(name="k")
        yield Fleet(cp, rival, creds.join_token, info.key_id, stale)
    finally:
        await rival.close()
        await store.close()


def depose_mid_write(store: Store, rival: Store) -> None:
    """The next fenced write finds that a new leader took over just before it."""
    real = store.fenced

    @contextlib.asynccontextmanager
    async def deposed(epoch: int) -> AsyncIterator[Any]:
        store.fenced = real  # type: ignore[method-assign]
        await rival.bump_epoch("http://new-leader:8080")
        async with real(epoch) as conn:
            yield conn

    store.fenced = deposed  # type: ignore[method-assign]


async def everything(store: Store) -> dict[str, Any]:
    settings = {r["key"]: r["value"] for r in await store._read(schema.settings.select())}
    settings.pop("leader_epoch")
    settings.pop("leader_url", None)
    return {
        "nodes": await store.list_nodes(),
        "models": await store.list_models(),
        "replicas": await store.list_replicas(),
        "keys": await store.list_api_keys(),
        "events": await store.count(schema.events),
        "settings": settings,
    }


Write = Callable[[Fleet], Awaitable[object]]


def _report(f: Fleet) -> Awaitable[object]:
    node = f.cp.state.nodes["n1"]
    return f.cp.agents.report(node, AgentReport(node="n1", address="10.0.0.9",
                                         inventory=NodeInventory(hostname="n1")))


async def _heartbeats(f: Fleet) -> None:
    f.cp.agents._pending_heartbeats["n1"] = time.time()
    await f.cp.agents.flush_heartbeats()


async def _reconcile_pass(f: Fleet) -> None:
    f.cp.state.models["m"].demand_at = time.time()
    await Reconciler(f.cp.state, f.cp.writes).run_pass(time.time(), f.cp.epoch)


async def _replica_activity(f: Fleet) -> None:
    f.cp.state.replicas["r1"].in_flight = 2
    await f.cp.replicas.flush_activity()


WRITES: dict[str, Write] = {
    "put_models": lambda f: f.cp.catalog.put([ModelSpec(name="late", engine="sim")]),
    "delete_model": lambda f: f.cp.catalog.delete("m"),
    "unpark": lambda f: f.cp.catalog.unpark("parked"),
    "set_node_state": lambda f: f.cp.nodes.set_state("n1", NodeState.CORDONED),
    "delete_node": lambda f: f.cp.nodes.delete("n1"),
    "drain_replica": lambda f: f.cp.replicas.drain("r1"),
    "create_api_key": lambda f: f.cp.keys.create(name="late"),
    "revoke_api_key": lambda f: f.cp.keys.revoke(f.key_id),
    "rotate_join_token": lambda f: f.cp.credentials.rotate_join_token(),
    "register": lambda f: f.cp.nodes.register(AgentRegistration(
        node="n2", join_token=f.join_token, agent_key=KEY)),
    "report": _report,
    "demand": lambda f: f.cp.catalog.demand("m"),
    "heartbeats": _heartbeats,
    "replica_activity": _replica_activity,
    "event": lambda f: f.cp.event("note", "x", "a late note"),
    "reconcile_pass": _reconcile_pass,
}


@pytest.mark.parametrize("kind", list(WRITES))
async def test_a_leader_deposed_mid_write_is_refused_and_steps_down(
    pg_database_url: str, kind: str
) -> None:
    async with leading(pg_database_url) as fleet:
        if kind == "demand":
            fleet.cp.state.models["m"].demand_at = None  # the first ask is written
        before = await everything(fleet.cp.store)
        depose_mid_write(fleet.cp.store, fleet.rival)
        with pytest.raises(NotLeaderError, match="stale"):
            await WRITES[kind](fleet)
        assert await everything(fleet.cp.store) == before
        assert not fleet.cp.is_leader and fleet.stale == [True]
        # Stepped down: the next write is refused at the door.
        with pytest.raises(NotLeaderError):
            await fleet.cp.event("note", "x", "another")
        assert fleet.stale == [True]  # stepped down once


async def test_usage_is_kept_even_from_a_deposed_instance(pg_database_url: str) -> None:
    # Counts a gateway observed are facts, added, never overwritten: a
    # standby's own gateway records them too (llmgw.control.writes).
    async with leading(pg_database_url) as fleet:
        await fleet.rival.bump_epoch()
        await fleet.cp.gateways.record_usage(
            [UsageRecord(minute=60, key_id="k", model="m", requests=3)])
        assert [r["requests"] for r in await fleet.cp.store.query_usage()] == [3]
        assert fleet.cp.is_leader and fleet.stale == []


async def test_a_deposed_leader_answers_like_a_standby_and_the_fleet_leads_again(
    pg_database_url: str,
) -> None:
    async with leader_and_standby(pg_database_url) as (leader, standby, creds):
        first_epoch = leader.cp.epoch
        depose_mid_write(leader.store, standby.store)
        headers = {"Authorization": f"Bearer {creds.admin_token}"}
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{leader.url}/admin/v1/apply", headers=headers,
                                     json={"models": [{"name": "late", "engine": "sim"}]})
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "standby"
        assert not leader.cp.is_leader
        assert await leader.store.list_models() == []
        # It let go of the lock: one of the two leads again, under a newer epoch.
        await eventually(lambda: any(i.cp.is_leader and i.cp.epoch > first_epoch + 1
                                     for i in (leader, standby)),
                         15, "a leader after the step-down", every_s=0.1)
        assert "late" not in leader.cp.state.models  # memory went back to the store's
