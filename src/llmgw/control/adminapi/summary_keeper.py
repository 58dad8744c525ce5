"""The route's fleet summary, kept between calls and changed only where the fleet changed.

Built from scratch (``summary.fleet_summary``), the summary is a view per
node, per replica and per model: at 10,000 nodes and 17,000 replicas that
was 140-200 ms a call, however little had changed. The keeper holds the
summary's totals (a ``SummaryBuilder``) and the views they were folded
from; each call it finds what changed, takes those views out and folds the
new ones in, under the same rules and from the same view builders, so the
answer is the one ``fleet_summary`` gives (a property test holds the two
together through random changes).

What changed is found without anything that writes to the fleet having to
report it, which is what keeps the cache exact as new code appears. Nodes
and replicas log every assignment to their fields themselves, into their
table's write log (writelog.py, from their ``__setattr__``): each call reads the fields a
view is built from only for the records written since the last call, into
tuples (``operator.attrgetter``), and compares them with the last call's.
Comparing every record each call instead was ~10 ms of a 12 ms call at
10,000 nodes and 17,000 replicas, for the ~200 nodes that had reported.
Records added, removed or put in another's place are found by comparing
the tables' keys and records (by identity, in C); the replicas' side of
this is summary_replicas.py. When the log has dropped
writes this keeper had not read (a keeper not asked for a long while), or
on a new fleet, every record is compared, as before. Models are few and
always compared. The same rule as the views' memo (views/memo.py)
applies: inventories, fabric and weight lists, shards and catalog entries
are replaced, never edited in place (an edit in place is no assignment).

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
from collections.abc import Callable
from itertools import compress
from typing import Any

import orjson

from llmgw.control import state as state_module
from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import Summary, SummaryBuilder
from llmgw.control.adminapi.summary_replicas import KeptReplicas
from llmgw.control.adminapi.views.models import ModelView, model_view
from llmgw.control.adminapi.views.nodes import NodeView, node_view
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.control.writelog import WriteLog
from llmgw.wire import NodeState

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
_NAME = operator.attrgetter("name")
_MODEL_INPUTS = operator.attrgetter(
    "spec",
    "parked",
    "failures",
    "last_error",
    "unplaceable_reason",
    "demand_at",
    "load_demand",
)


class SummaryKeeper:
    def __init__(self) -> None:
        self._state: FleetState | None = None
        self._now = -math.inf
        # Idle replicas are the keeper's (KeptReplicas.idle), not the builder's.
        self._builder = SummaryBuilder(StoreStatus(members=[]), collect_idle=False)
        self._nodes: dict[str, NodeView] = {}
        self._node_names: list[str] = []
        self._node_records: list[NodeRecord] = []
        self._node_inputs: dict[str, tuple[Any, ...]] = {}
        # The table the names and records were listed from, and its write count.
        self._node_table: object = None
        self._node_version: int | None = None
        # The fleet's write logs (its tables', writelog.py) and where this
        # keeper read them to.
        self._node_log: WriteLog[NodeRecord] | None = None
        self._node_writes = 0
        self._replica_log: WriteLog[ReplicaRecord] | None = None
        self._replica_writes = 0
        self._node_state: dict[str, NodeState] = {}
        # (when its silence grace ends, node): nodes whose state to ask again.
        self._deadlines: list[tuple[float, str]] = []
        # node -> the one entry of ``_deadlines`` that counts for it.
        self._scheduled: dict[str, float] = {}
        self._grace = state_module.UNREACHABLE_AFTER_S
        self._stale_nodes: set[str] = set()
        self._replicas = KeptReplicas(self._builder)
        self._models: dict[str, ModelView] = {}
        self._model_names: list[str] = []
        self._model_inputs: list[tuple[object, ...]] = []
        # On-demand and external models: folded again every call.
        self._timed: set[str] = set()

    def summary(self, state: FleetState, now: float, store: StoreStatus) -> Summary:
        """``fleet_summary(state, now, store)``, from what changed since the last call."""
        self._refresh(state, now)  # first: it may start over with a new builder
        self._builder.set_idle(self._replicas.idle.entries(now))
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
        body["idle_replicas"] = orjson.Fragment(self._replicas.idle.json(now))
        return orjson.dumps(body)

    def _refresh(self, state: FleetState, now: float) -> None:
        if (
            state is not self._state
            or now < self._now
            or self._grace != state_module.UNREACHABLE_AFTER_S
        ):
            self._reset(state)
        # A table without a log (a plain dict given to FleetState), or
        # another log than last call's: every record is compared.
        node_log: WriteLog[NodeRecord] | None = getattr(state.nodes, "writes", None)
        replica_log: WriteLog[ReplicaRecord] | None = getattr(state.replicas, "writes", None)
        node_writes = (node_log.since(self._node_writes)
                       if node_log is not None and node_log is self._node_log else None)
        replica_writes = (replica_log.since(self._replica_writes)
                          if replica_log is not None and replica_log is self._replica_log
                          else None)
        self._node_log, self._replica_log = node_log, replica_log
        self._node_writes = node_log.position() if node_log is not None else 0
        self._replica_writes = replica_log.position() if replica_log is not None else 0
        self._now = now
        touched_models: set[str] = set()
        moved_nodes = self._sync_nodes(state, now, node_writes)
        self._replicas.sync(
            state, now, replica_writes, moved_nodes, touched_models, self._stale_nodes
        )
        self._sync_nodes_held(state, now)
        self._sync_models(state, now, touched_models)

    # -- nodes ---------------------------------------------------------------------

    def _sync_nodes(
        self, state: FleetState, now: float, written: list[NodeRecord] | None
    ) -> set[str]:
        """Find changed nodes (folded again later); the names whose reachability
        moved, or that came or went.

        ``written``: the nodes whose fields were assigned since the last call
        (the node table's write log), or None to look at every node.

        A node's state is asked for again only when its fields changed or the
        clock neared the end of its silence grace (``reachable_until``, kept
        in a heap): a report every 5 s from each of 10,000 nodes changes
        ``last_seen`` constantly and the state almost never.
        """
        nodes = state.nodes
        recheck: set[str] = set()
        moved: set[str] = set()
        self._find_changed_nodes(nodes, written, recheck, moved)
        self._due_silences(now, recheck)
        self._recheck_node_states(nodes, now, recheck, moved)
        return moved

    def _find_changed_nodes(
        self,
        nodes: dict[str, NodeRecord],
        written: list[NodeRecord] | None,
        recheck: set[str],
        moved: set[str],
    ) -> None:
        """Add to ``recheck`` the nodes written to (or all, when the log cannot say),
        to ``moved`` the ones gone."""
        kept = self._node_inputs
        # A NodeTable counts its writes: when the count has not moved, no node
        # came, went or was put in another's place, and the table is not even
        # listed (touching 10,000 records, ~1 ms a call).
        version = getattr(nodes, "version", None)
        same_table = (
            version is not None and nodes is self._node_table and version == self._node_version
        )
        self._node_table, self._node_version = nodes, version
        if same_table:
            names, records = self._node_names, self._node_records
        else:
            names, records = list(nodes), list(nodes.values())
        if written is not None and same_table:
            self._read_written_nodes(nodes, set(map(_NAME, written)), recheck)
        elif written is not None and names == self._node_names:
            # The same names: only nodes written to, or put in another's
            # place (found in C, by identity), can differ.
            touched = set(map(_NAME, written))
            if records != self._node_records:
                touched.update(compress(names, map(operator.is_not, records, self._node_records)))
            self._read_written_nodes(nodes, touched, recheck)
        else:
            # Every node, read again (a new fleet, names that came or went,
            # or writes the log no longer holds).
            old, kept = kept, dict(zip(names, map(_NODE_INPUTS, records), strict=True))
            for name, now_in in kept.items():
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
            self._node_inputs = kept
        self._node_names, self._node_records = names, records

    def _due_silences(self, now: float, recheck: set[str]) -> None:
        """Add to ``recheck`` the nodes whose silence grace ends about now."""
        # Silences nearing the grace (a second's margin for rounding).
        deadlines, scheduled = self._deadlines, self._scheduled
        while deadlines and deadlines[0][0] <= now + 1.0:
            when, name = heapq.heappop(deadlines)
            if scheduled.get(name) == when:  # else: superseded by a later report
                del scheduled[name]
                recheck.add(name)

    def _recheck_node_states(
        self, nodes: dict[str, NodeRecord], now: float, recheck: set[str], moved: set[str]
    ) -> None:
        """Ask each node in ``recheck`` its state again; add to ``moved`` those whose
        reachability changed, and keep the heap of silences."""
        deadlines, scheduled = self._deadlines, self._scheduled
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
                # put back for the new one. A push per report would be a heap of
                # ~60,000 superseded entries at 10,000 nodes reporting every
                # 5 s, 2,000 new objects a second for the collector.
                when = node.reachable_until()
                due = scheduled.get(name)
                if due is None or when < due:
                    scheduled[name] = when
                    heapq.heappush(deadlines, (when, name))

    def _read_written_nodes(
        self, nodes: dict[str, NodeRecord], touched: set[str], recheck: set[str]
    ) -> None:
        """Note the nodes of ``touched`` whose fields differ: to recheck, and
        to fold again when the view's own fields do."""
        kept = self._node_inputs
        for name in touched:
            node = nodes.get(name)
            if node is None:  # a record of another fleet, or gone before
                continue
            now_in, before = _NODE_INPUTS(node), kept[name]
            if now_in != before:
                kept[name] = now_in
                recheck.add(name)  # its state, at least, is asked for again
                if now_in[:_VIEWED] != before[:_VIEWED]:
                    self._stale_nodes.add(name)

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
            view = model_view(record, self._replicas.tally, now)  # type: ignore[arg-type]
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
