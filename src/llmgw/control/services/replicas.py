"""Replicas: drained on request, and their use written back for the standbys.

The reconciler places and retires replicas (control.reconciler); what is
left to a service is an operator's drain and the batched write of each
replica's use.
"""

from __future__ import annotations

from llmgw.control.inflight import StoredActivity
from llmgw.control.rows import replica_row
from llmgw.control.services.core import Core, found
from llmgw.control.state import ReplicaRecord
from llmgw.wire import ReplicaState


class Replicas:
    def __init__(self, core: Core) -> None:
        self.core = core
        # What the store holds of each replica's use, so a standby's views
        # see busy replicas busy (flush_activity).
        self._stored_activity = StoredActivity()

    def _activity(self) -> dict[str, tuple[int, float | None]]:
        return {r.id: (r.in_flight, r.last_request_at) for r in self.core.state.replicas.values()}

    def loaded(self) -> None:
        """The replicas were just read from the store: their use there is theirs now."""
        self._stored_activity.stored(self._activity())

    async def drain(self, replica_id: str) -> ReplicaRecord:
        core = self.core
        core.require_leader()
        replica = found(core.state.replicas, replica_id, "replica")
        if replica.draining:
            return replica  # asked twice: nothing more to do
        replica.move_to(ReplicaState.DRAINING, replica.reason)
        await core.writes.write_replicas([replica_row(replica)])
        await core.event("drain", replica.model, f"replica {replica_id} draining on request")
        await core.state.bump_routing()
        core.wake_reconciler()
        return replica

    async def flush_activity(self) -> int:
        """Store the use of replicas whose stored use is out of date (the leader's only).

        Called every HEARTBEAT_FLUSH_S: at most one row update per replica per
        flush, and for a replica busy for long, one per ACTIVITY_SLACK_S
        (control.inflight). Returns the number of rows written.
        """
        if not self.core.is_leader:
            return 0
        due = self._stored_activity.due(self._activity())
        if due:
            await self.core.writes.touch_replicas(due)
            self._stored_activity.stored(due)
        return len(due)
