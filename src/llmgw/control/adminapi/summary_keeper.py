"""The route's fleet summary, kept between calls and changed only where the fleet changed.

Built from scratch (``summary.fleet_summary``), the summary is a view per
node, per replica and per model: at 10,000 nodes and 17,000 replicas that
was 140-200 ms a call, however little had changed. The keeper holds the
summary's totals (a ``SummaryBuilder``) and the views they were folded
from; each call it finds what changed, takes those views out and folds the
new ones in, under the same rules and from the same view builders, so the
answer is the one ``fleet_summary`` gives (a property test holds the two
together through random changes).

What changed is found by comparison, not by being told: each call reads
the fields a view is built from, for every node, replica and model, into
tuples (``operator.attrgetter``, in C) and compares them with the last
call's (in C; equal fields are usually the same objects). Nothing that
writes to the fleet has to remember to report it, which is what keeps the
cache exact as new code appears. The same rule as the views' memo
(views/memo.py) applies: inventories, fabric and weight lists, shards and
catalog entries are replaced, never edited in place.

Time moves answers too, and is handled where it does: a node's state
(read each call), replicas on a node that turned unreachable or back,
on-demand and external models (their wanted count and URL states depend on
the clock), and the idle list, recomputed each call from the replicas that
can be idle.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import compress, count
from typing import Any

import orjson

from llmgw.control import state as state_module
from llmgw.control.adminapi.idlelist import IdleList
from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import Summary, SummaryBuilder
from llmgw.control.adminapi.views.models import ModelView, model_view
from llmgw.control.adminapi.views.nodes import NodeView, node_view
from llmgw.control.adminapi.views.replicas import ReplicaView, replica_view
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import NodeState, ReplicaState

# What the summary reads of each record, besides the clock and the other
# records. A node's view reads its state, which its report times (heard)
# move only past the silence grace: those are watched apart.
# (Its registration time is not read: a state depends on it only before the
# node's first report, when it is unreachable whatever it says.)
_NODE_INPUTS = operator.attrgetter(
    "inventory",
    "fabrics",
    "weights",
    "admin_state",
    "last_seen",
    "listening_since",
)
_VIEWED = 4  # the view's own fields; the rest only time its state
# A replica's model and shards never change while it is in the table
# (replicatable.py): a record put in another's place is told apart by
# comparing the records themselves, in C, as the ids are.
_REPLICA_INPUTS = operator.attrgetter(
    "state",
    "created_at",
    "ready_at",
    "last_request_at",
    "in_flight",
)
_MODEL_INPUTS = operator.attrgetter(
    "spec",
    "parked",
    "failures",
    "last_error",
    "unplaceable_reason",
    "demand_at",
    "load_demand",
)
_LIVE = frozenset({ReplicaState.READY.value, ReplicaState.STARTING.value, "unreachable"})


def _differing(now: list[Any], before: list[Any]) -> Iterator[int]:
    """Indexes where two lists of equal length differ (``!=``, in C)."""
    return compress(count(), map(operator.ne, now, before))


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


class _Tally:
    """ReplicaTally's answers (views.models) from the keeper's replica counts."""

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


class SummaryKeeper:
    def __init__(self) -> None:
        self._state: FleetState | None = None
        self._now = -math.inf
        # Idle replicas are the keeper's (``_idle``), not the builder's.
        self._builder = SummaryBuilder(StoreStatus(members=[]), collect_idle=False)
        self._nodes: dict[str, NodeView] = {}
        self._node_names: list[str] = []
        self._node_inputs: list[tuple[Any, ...]] = []
        self._node_state: dict[str, NodeState] = {}
        # (when its silence grace ends, node): nodes whose state to ask again.
        self._deadlines: list[tuple[float, str]] = []
        # node -> the one entry of ``_deadlines`` that counts for it.
        self._scheduled: dict[str, float] = {}
        self._grace = state_module.UNREACHABLE_AFTER_S
        self._stale_nodes: set[str] = set()
        self._replicas: dict[str, _Replica] = {}
        self._replica_ids: list[str] = []
        self._replica_inputs: list[tuple[object, ...]] = []
        self._replica_records: list[ReplicaRecord] = []
        self._tally = _Tally()
        # The idle list's candidates (idlelist.py).
        self._idle = IdleList()
        self._models: dict[str, ModelView] = {}
        self._model_names: list[str] = []
        self._model_inputs: list[tuple[object, ...]] = []
        # On-demand and external models: folded again every call.
        self._timed: set[str] = set()

    def summary(self, state: FleetState, now: float, store: StoreStatus) -> Summary:
        """``fleet_summary(state, now, store)``, from what changed since the last call."""
        self._refresh(state, now)  # first: it may start over with a new builder
        self._builder.set_idle(self._idle.entries(now))
        return self._builder.finish(store)

    def summary_json(self, state: FleetState, now: float, store: StoreStatus) -> bytes:
        """``summary(...).model_dump_json()``, with the idle list written straight to JSON.

        The idle list is the one part as long as the fleet (7,500 replicas at
        10,000 nodes in bench/admin.py): as validated models and back it was
        most of a call that had nothing else to do (see idlelist.py).
        """
        self._refresh(state, now)
        self._builder.set_idle([])
        body = self._builder.finish(store).model_dump(mode="json")
        body["idle_replicas"] = orjson.Fragment(self._idle.json(now))
        return orjson.dumps(body)

    def _refresh(self, state: FleetState, now: float) -> None:
        if (
            state is not self._state
            or now < self._now
            or self._grace != state_module.UNREACHABLE_AFTER_S
        ):
            self._reset(state)
        self._now = now
        touched_models: set[str] = set()
        moved_nodes = self._sync_nodes(state, now)
        self._sync_replicas(state, now, moved_nodes, touched_models)
        self._sync_nodes_held(state, now)
        self._sync_models(state, now, touched_models)

    # -- nodes ---------------------------------------------------------------------

    def _sync_nodes(self, state: FleetState, now: float) -> set[str]:
        """Find changed nodes (folded again later); the names whose reachability
        moved, or that came or went.

        A node's state is asked for again only when its fields changed or the
        clock neared the end of its silence grace (``reachable_until``, kept
        in a heap): a report every 5 s from each of 10,000 nodes changes
        ``last_seen`` constantly and the state almost never.
        """
        nodes = state.nodes
        names = list(nodes)
        # One read of every node per call (touching 10,000 records is the
        # cost): the view's fields first, then its report times.
        inputs = list(map(_NODE_INPUTS, nodes.values()))
        recheck: set[str] = set()
        moved: set[str] = set()
        if names == self._node_names:
            before_all = self._node_inputs
            if inputs != before_all:
                # Which ones, found in C: with reports arriving all the time
                # a few nodes differ at every call, out of 10,000.
                for index in _differing(inputs, before_all):
                    name, now_in, before = names[index], inputs[index], before_all[index]
                    recheck.add(name)  # its state, at least, is asked for again
                    if now_in[:_VIEWED] != before[:_VIEWED]:
                        self._stale_nodes.add(name)
        else:
            old = dict(zip(self._node_names, self._node_inputs, strict=True))
            for name, now_in in zip(names, inputs, strict=True):
                was = old.pop(name, None)
                if was is None or was != now_in:
                    self._stale_nodes.add(name)
                    recheck.add(name)
            for name in old:  # gone
                moved.add(name)
                self._node_state.pop(name, None)
                view = self._nodes.pop(name, None)
                if view is not None:
                    self._builder.add_node(view, -1)
                self._stale_nodes.discard(name)
        self._node_names, self._node_inputs = names, inputs
        # Silences nearing the grace (a second's margin for rounding).
        deadlines, scheduled = self._deadlines, self._scheduled
        while deadlines and deadlines[0][0] <= now + 1.0:
            when, name = heapq.heappop(deadlines)
            if scheduled.get(name) == when:  # else: superseded by a later report
                del scheduled[name]
                recheck.add(name)
        for name in recheck:
            node = nodes.get(name)
            if node is None:
                continue
            now_state = node.state(now)
            before_state = self._node_state.get(name)
            if now_state is not before_state:
                self._node_state[name] = now_state
                self._stale_nodes.add(name)
                if before_state is None or (before_state is NodeState.UNREACHABLE) != (
                    now_state is NodeState.UNREACHABLE
                ):
                    moved.add(name)
            if now_state is not NodeState.UNREACHABLE:
                # Only ever earlier: a report moves the deadline later, and
                # the entry already there then asks a little early and is
                # put back for the new one. A push per report was a heap of
                # ~60,000 superseded entries at 10,000 nodes reporting every
                # 5 s, 2,000 new objects a second for the collector.
                when = node.reachable_until()
                kept = scheduled.get(name)
                if kept is None or when < kept:
                    scheduled[name] = when
                    heapq.heappush(deadlines, (when, name))
        return moved

    def _sync_nodes_held(self, state: FleetState, now: float) -> None:
        """Fold again the nodes that changed, or whose held devices did."""
        stale, self._stale_nodes = self._stale_nodes, set()
        for name in stale:
            node = state.nodes.get(name)
            old = self._nodes.pop(name, None)
            if old is not None:
                self._builder.add_node(old, -1)
            if node is None:
                continue
            held = {
                number: replica.id
                for replica in state.replicas.on_node(name)
                for shard in replica.shards
                if shard.node == name
                for number in shard.device_numbers
            }
            view = node_view(node, now, held, with_devices=False)
            self._nodes[name] = view
            self._builder.add_node(view)

    # -- replicas ------------------------------------------------------------------

    def _sync_replicas(
        self, state: FleetState, now: float, moved_nodes: set[str], touched: set[str]
    ) -> None:
        replicas = state.replicas
        ids = list(replicas)
        records = list(replicas.values())
        inputs = list(map(_REPLICA_INPUTS, records))
        changed: list[ReplicaRecord] = []
        gone: list[str] = []
        if ids == self._replica_ids:
            # The same replicas (the usual case: requests move their use and
            # counts all the time): the ones that differ, found in C.
            old_records, old_inputs = self._replica_records, self._replica_inputs
            if inputs != old_inputs:
                changed.extend(records[i] for i in _differing(inputs, old_inputs))
            if records != old_records:
                # A record in another's place: changed unless equal field for
                # field (its model and shards included), which ``!=`` asks.
                listed = {r.id for r in changed}
                changed.extend(
                    records[i]
                    for i in compress(count(), map(operator.is_not, records, old_records))
                    if records[i].id not in listed and records[i] != old_records[i]
                )
            self._replica_inputs, self._replica_records = inputs, records
        elif (
            ids != self._replica_ids
            or records != self._replica_records
            or inputs != self._replica_inputs
        ):
            old = dict(
                zip(
                    self._replica_ids,
                    zip(self._replica_records, self._replica_inputs, strict=True),
                    strict=True,
                )
            )
            for rid, record, now_inputs in zip(ids, records, inputs, strict=True):
                before = old.pop(rid, None)
                # A record in another's place counts as changed unless equal
                # field for field (its model and shards included).
                if (
                    before is None
                    or before[1] != now_inputs
                    or (before[0] is not record and before[0] != record)
                ):
                    changed.append(record)
            gone = list(old)
            self._replica_ids, self._replica_inputs = ids, inputs
            self._replica_records = records
        # Replicas whose node turned unreachable (or back, or came or went).
        again = {r.id for name in moved_nodes for r in replicas.on_node(name)}
        seen = {r.id for r in changed}
        changed.extend(replicas[rid] for rid in again if rid not in seen and rid in replicas)
        for rid in gone:
            self._drop_replica(rid, touched)
        for record in changed:
            self._drop_replica(record.id, touched)
            self._add_replica(record, state, now, touched)

    def _add_replica(
        self, record: ReplicaRecord, state: FleetState, now: float, touched: set[str]
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
        kept = _Replica(view, nodes, used, idle_since)
        self._replicas[record.id] = kept
        self._builder.add_replica(view)
        per_state = self._tally.counts.setdefault(view.model, {})
        per_state[view.state] = per_state.get(view.state, 0) + 1
        if used is not None:
            self._tally.used.setdefault(view.model, {})[record.id] = used
        if idle_since is not None:
            self._idle.add(record.id, idle_since, view.model, view.gpus)
        touched.add(view.model)
        self._stale_nodes.update(nodes)

    def _drop_replica(self, rid: str, touched: set[str]) -> None:
        kept = self._replicas.pop(rid, None)
        if kept is None:
            return
        view = kept.view
        self._builder.add_replica(view, -1)
        per_state = self._tally.counts[view.model]
        per_state[view.state] -= 1
        if not per_state[view.state]:
            del per_state[view.state]
        if not per_state:
            del self._tally.counts[view.model]
        if kept.used is not None:
            used = self._tally.used[view.model]
            del used[rid]
            if not used:
                del self._tally.used[view.model]
        self._idle.drop(rid)
        touched.add(view.model)
        self._stale_nodes.update(kept.nodes)

    # -- models --------------------------------------------------------------------

    def _sync_models(self, state: FleetState, now: float, touched: set[str]) -> None:
        models = state.models
        names = list(models)
        inputs = list(map(_MODEL_INPUTS, models.values()))
        redo = set(touched) | self._timed
        if names != self._model_names or inputs != self._model_inputs:
            old = dict(zip(self._model_names, self._model_inputs, strict=True))
            for name, now_inputs in zip(names, inputs, strict=True):
                before = old.pop(name, None)
                if before is None or before != now_inputs:
                    redo.add(name)
            redo.update(old)  # gone
            self._model_names, self._model_inputs = names, inputs
        for name in redo:
            old_view = self._models.pop(name, None)
            if old_view is not None:
                self._builder.add_model(old_view, -1)
            self._timed.discard(name)
            record = models.get(name)
            if record is None:
                continue
            view = model_view(record, self._tally, now)  # type: ignore[arg-type]
            self._models[name] = view
            self._builder.add_model(view)
            spec = record.spec
            if spec.on_demand or spec.external is not None:
                # What it should have, or its URLs' states, move with the clock.
                self._timed.add(name)

    # -- starting over -------------------------------------------------------------

    def _reset(self, state: FleetState) -> None:
        """Forget everything: another fleet, or a clock that went back."""
        self.__init__()  # type: ignore[misc]
        self._state = state


def kept_summary() -> Callable[[FleetState, float, StoreStatus], Summary]:
    """A summary function for one route: ``fleet_summary``'s answer, kept between calls."""
    return SummaryKeeper().summary


__all__ = ["SummaryKeeper", "kept_summary"]
