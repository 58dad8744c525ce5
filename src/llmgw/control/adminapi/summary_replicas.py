"""The fleet summary keeper's replica side: which replicas' views changed, and what they count.

The keeper (summary_keeper.py) holds the summary's totals; this part keeps
the view of every replica folded into them, finds the replicas whose view
may have changed since the last call -- written to (the table's write log),
put in another's place, or on a node whose reachability moved -- and folds
those again. Beside the totals it keeps what the models' views and the idle
list are built from: replicas per model and state, when each model was last
used, and the replicas that can be idle. Kept here so none of these is
recounted from 17,000 replicas on a call where a hundred changed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import compress, count

from llmgw.control.adminapi.idlelist import IdleList
from llmgw.control.adminapi.summary import SummaryBuilder
from llmgw.control.adminapi.views.replicas import ReplicaView, replica_view
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import ReplicaState

_ID = operator.attrgetter("id")
# What a replica's view reads of its record. Its model and shards never
# change while it is in the table (replicatable.py): a record put in
# another's place is told apart by comparing the records themselves, in C,
# as the ids are.
_REPLICA_INPUTS = operator.attrgetter(
    "state",
    "created_at",
    "ready_at",
    "last_request_at",
    "in_flight",
)
_LIVE = frozenset({ReplicaState.READY.value, ReplicaState.STARTING.value, "unreachable"})


@dataclass(slots=True)
class _Replica:
    """What the keeper remembers of one replica's view."""

    view: ReplicaView
    nodes: tuple[str, ...]
    # When it was last used (ReplicaTally's rule), or None when it does not
    # count towards its model's use (not live, or draining).
    used: float | None
    # Since when it has been idle, when it can be idle at all (ready, nothing
    # in flight, ready or used once): the idle list's candidates.
    since: float | None


class ReplicaTally:
    """views.models' ReplicaTally answers, from the kept replicas' counts."""

    __slots__ = ("counts", "used")

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        # model -> replica id -> when last used
        self.used: dict[str, dict[str, float]] = {}

    def of(self, model: str) -> dict[str, int]:
        return self.counts.get(model, {})

    def last_used(self, model: str) -> float | None:
        found = self.used.get(model)
        return max(found.values()) if found else None

    def loaded_on(self, adapter: str) -> int:
        # The summary's views carry no adapters (detail-less): its
        # ``adapters`` section says where each is loaded (routers/fleet.py).
        return 0


class KeptReplicas:
    """Every replica's view, folded into ``builder``'s totals and kept in step.

    ``sync`` adds to the sets it is given the models whose views must be
    built again and the nodes whose held devices may have changed: the
    keeper folds those in turn.
    """

    def __init__(self, builder: SummaryBuilder) -> None:
        self._builder = builder
        self._replicas: dict[str, _Replica] = {}
        self._ids: list[str] = []
        self._inputs: dict[str, tuple[object, ...]] = {}
        self._records: list[ReplicaRecord] = []
        # The table the ids and records were listed from, and its write count.
        self._table: object = None
        self._version: int | None = None
        self.tally = ReplicaTally()
        # The idle list's candidates (idlelist.py).
        self.idle = IdleList()

    def sync(
        self,
        state: FleetState,
        now: float,
        written: list[ReplicaRecord] | None,
        moved_nodes: set[str],
        touched_models: set[str],
        stale_nodes: set[str],
    ) -> None:
        """Fold again the replicas that changed.

        ``written``: the replicas whose fields were assigned since the last
        call (the replica table's write log), or None to compare every replica.
        ``moved_nodes``: nodes that turned unreachable or back, came or went.
        """
        replicas = state.replicas
        changed: list[ReplicaRecord] = []
        gone: list[str] = []
        # The table counts its writes (ReplicaTable.version): when it has not
        # moved, no replica came, went or was put in another's place, and the
        # table is not even listed (touching 17,000 records, ~2 ms a call).
        version = getattr(replicas, "version", None)
        same_table = version is not None and replicas is self._table and version == self._version
        self._table, self._version = replicas, version
        if written is not None and same_table:
            self._read_written(replicas, written, set(), changed)
        else:
            self._compare(replicas, written, changed, gone)
        # Replicas whose node turned unreachable (or back, or came or went).
        again = {r.id for name in moved_nodes for r in replicas.on_node(name)}
        seen = {r.id for r in changed}
        changed.extend(replicas[rid] for rid in again if rid not in seen and rid in replicas)
        for rid in gone:
            self._drop(rid, touched_models, stale_nodes)
        for record in changed:
            self._drop(record.id, touched_models, stale_nodes)
            self._add(record, state, now, touched_models, stale_nodes)

    def _read_written(
        self,
        replicas: dict[str, ReplicaRecord],
        written: list[ReplicaRecord],
        skip: set[str],
        changed: list[ReplicaRecord],
    ) -> None:
        """Add to ``changed`` the replicas written to whose fields differ."""
        kept = self._inputs
        for rid in set(map(_ID, written)) - skip:
            found = replicas.get(rid)
            if found is None:  # a record of another fleet, or gone before
                continue
            now_in = _REPLICA_INPUTS(found)
            if now_in != kept[rid]:
                kept[rid] = now_in
                changed.append(found)

    def _compare(
        self,
        replicas: dict[str, ReplicaRecord],
        written: list[ReplicaRecord] | None,
        changed: list[ReplicaRecord],
        gone: list[str],
    ) -> None:
        """The table listed and compared with the last call's: replicas that
        came, went or were put in another's place, and (``written`` None)
        every replica's fields."""
        ids = list(replicas)
        records = list(replicas.values())
        kept = self._inputs
        if written is not None and ids == self._ids:
            # The same ids: only records written to, or put in another's
            # place (found in C, by identity), can differ.
            old_records = self._records
            listed: set[str] = set()
            if records != old_records:
                # A record in another's place: changed unless equal field for
                # field (its model and shards included), which ``!=`` asks.
                for i in compress(count(), map(operator.is_not, records, old_records)):
                    record = records[i]
                    kept[record.id] = _REPLICA_INPUTS(record)
                    if record != old_records[i]:
                        changed.append(record)
                        listed.add(record.id)
            self._read_written(replicas, written, listed, changed)
        else:
            old = dict(zip(self._ids, self._records, strict=True))
            inputs = dict(zip(ids, map(_REPLICA_INPUTS, records), strict=True))
            for rid, record in zip(ids, records, strict=True):
                before = old.pop(rid, None)
                # A record in another's place counts as changed unless equal
                # field for field (its model and shards included).
                if (
                    before is None
                    or kept.get(rid) != inputs[rid]
                    or (before is not record and before != record)
                ):
                    changed.append(record)
            gone.extend(old)
            self._inputs = inputs
        self._ids, self._records = ids, records

    def _add(
        self,
        record: ReplicaRecord,
        state: FleetState,
        now: float,
        touched_models: set[str],
        stale_nodes: set[str],
    ) -> None:
        view = replica_view(record, state.nodes, now, detail=False)
        nodes = tuple(s.node for s in record.shards)
        used = None
        if view.state in _LIVE and not view.draining:
            used = (
                math.inf
                if record.in_flight > 0
                else max(record.last_request_at or 0.0, record.ready_at or 0.0, record.created_at)
            )
        since = record.last_request_at or record.ready_at
        idle_since = since if view.state == "ready" and record.in_flight == 0 else None
        self._replicas[record.id] = _Replica(view, nodes, used, idle_since)
        self._builder.add_replica(view)
        per_state = self.tally.counts.setdefault(view.model, {})
        per_state[view.state] = per_state.get(view.state, 0) + 1
        if used is not None:
            self.tally.used.setdefault(view.model, {})[record.id] = used
        if idle_since is not None:
            self.idle.add(record.id, idle_since, view.model, view.gpus)
        touched_models.add(view.model)
        stale_nodes.update(nodes)

    def _drop(self, rid: str, touched_models: set[str], stale_nodes: set[str]) -> None:
        kept = self._replicas.pop(rid, None)
        if kept is None:
            return
        view = kept.view
        self._builder.add_replica(view, -1)
        per_state = self.tally.counts[view.model]
        per_state[view.state] -= 1
        if not per_state[view.state]:
            del per_state[view.state]
        if not per_state:
            del self.tally.counts[view.model]
        if kept.used is not None:
            used = self.tally.used[view.model]
            del used[rid]
            if not used:
                del self.tally.used[view.model]
        self.idle.drop(rid)
        touched_models.add(view.model)
        stale_nodes.update(kept.nodes)


__all__ = ["KeptReplicas", "ReplicaTally"]
