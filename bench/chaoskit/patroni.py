"""The database's faults: a Patroni switchover and the death of the database leader.

The fleet runs on a replicated store (tests/store_cluster.py: etcd and three
PostgreSQL members under Patroni, synchronous replication) through the
libpq multi-host URL an operator gives ``llmgw serve``. Whole again also
needs the control plane leading under a new epoch: the advisory lock it
held is not replicated, so it must have re-taken leadership on the new
primary.
"""

from __future__ import annotations

import asyncio
import time

from tests.store_cluster import PatroniCluster

from chaoskit.load import Load
from chaoskit.run import OUTAGE_WATCH_S, Frame, Injected


async def _whole_cluster(frame: Frame, cluster: PatroniCluster) -> int:
    """Wait until every member is back; the control plane's epoch before the fault."""
    await asyncio.to_thread(cluster.wait, cluster.healthy, 60, "a whole cluster")
    leader = await frame.fleet.api.leader()
    assert leader is not None, "no control-plane leader before the fault"
    return leader[1]


def _injected(frame: Frame, epoch: int, at: float, note: str) -> Injected:
    """The fault done at ``at``; whole again once the control plane leads under a new epoch."""
    injected = Injected(ended=at, hold_until=at + OUTAGE_WATCH_S, notes=[note])

    async def led_again() -> bool:
        now = await frame.fleet.api.leader()
        if now is None or now[1] <= epoch:
            return False
        if not any(n.startswith("control plane") for n in injected.notes):
            injected.notes.append(f"control plane leading again (epoch {now[1]})"
                                  f" {time.monotonic() - at:.1f} s after the fault")
        return True

    injected.also = led_again
    return injected


async def switchover(frame: Frame, load: Load, cluster: PatroniCluster) -> Injected:
    epoch = await _whole_cluster(frame, cluster)
    old = cluster.leader()
    candidate = cluster.sync_standby()
    assert old and candidate, cluster.cluster()
    at = time.monotonic()
    await asyncio.to_thread(cluster.switchover, candidate)
    return _injected(frame, epoch, at, f"switchover {old} -> {candidate}")


async def leader_kill(frame: Frame, load: Load, cluster: PatroniCluster) -> Injected:
    """kill -9 of the leader member's Patroni and PostgreSQL together: its machine died."""
    epoch = await _whole_cluster(frame, cluster)
    old = cluster.leader()
    assert old, cluster.cluster()
    at = time.monotonic()
    await asyncio.to_thread(cluster.crash_member, old)
    return _injected(frame, epoch, at, f"killed member {old} (Patroni and PostgreSQL)")
