"""Phase one of a pass: sort each model's replicas, count failures, decide removals.

For one model at a time: failed starts are counted, against the model and
against the nodes they ran on (node_failures.py), and the model is parked
after too many on too many nodes (``_should_park``); replicas on lost nodes
are replaced, drains are finished, replicas on a draining node or of an
outdated shape are moved make-before-break, extras are retired, and what is
still missing is left for phase two to place (shortfall.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw import memory
from llmgw.control.scheduler.decisions import (
    BACKING_OFF,
    PARKED,
    Decisions,
    ModelOutcome,
    ModelUpdate,
    ModelWork,
    Policy,
    Removal,
)
from llmgw.control.scheduler.demand import desired_count, idle_for
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.node_failures import NodeFailureBook, span
from llmgw.control.scheduler.placementnode import DeviceCache, PlacementNode
from llmgw.control.scheduler.retire import finish_drain, retire, retire_order
from llmgw.control.state import FleetState, ModelRecord, ReplicaRecord
from llmgw.wire import ModelSpec, NodeState, ReplicaState


class ShapeCheck:
    """Does a replica still match its model's entry (shards, devices, class)?

    A catalog edit that changes the shape (gpus, nodes, classes) makes old
    replicas wrong; they are replaced make-before-break like those on a
    draining node. Device classes are looked up lazily per node.
    """

    def __init__(
        self,
        state: FleetState,
        cache: DeviceCache,
        views: Mapping[str, PlacementNode] | None = None,
    ) -> None:
        self.state = state
        self._cache = cache
        # node -> device number -> class, looked up once per pass: from the
        # snapshot's views when given (current, and one lookup away), else
        # from the digested inventories.
        self._views = views
        self._classes: dict[str, dict[int, str]] = {}

    def fits(
        self, replica: ReplicaRecord, spec: ModelSpec, on: frozenset[str] | None = None
    ) -> bool:
        """Whether the replica still matches ``spec``; and, given ``on``, whether
        every node it spans is in it (one walk over its shards for both)."""
        if len(replica.shards) != spec.nodes:
            return False
        per_node = spec.gpus // max(1, spec.nodes)
        accepted = spec.gpu_classes
        for shard in replica.shards:
            if on is not None and shard.node not in on:
                return False
            numbers = shard.device_numbers
            if len(numbers) != per_node:
                return False
            classes = self._classes.get(shard.node)
            if classes is None:
                classes = self._classes[shard.node] = self._node_classes(shard.node)
            for number in numbers:
                gpu_class = classes.get(number)
                # A device missing from the inventory is the agent's to
                # explain (it reports the replica failed); not a shape change.
                if gpu_class is not None and gpu_class not in accepted:
                    return False
        return True

    def nodes_that_fit(self, spec: ModelSpec, now: float, at_most: int) -> int:
        """Ready nodes with enough healthy devices of a class ``spec`` accepts
        (free or not), counted up to ``at_most``: the nodes a model could
        ever be retried on, for parking."""
        request = Request.for_spec(spec)
        found = 0
        for node in self.state.nodes.values():
            if found >= at_most:
                break
            if node.state(now) is not NodeState.READY:
                continue
            if request.multi_node and not node.fabrics:
                continue
            capacity = self._cache.get(node).capacity
            if any(capacity.get(c, 0) >= request.per_node for c in request.classes):
                found += 1
        return found

    def _node_classes(self, node: str) -> dict[int, str]:
        if self._views is not None:
            view = self._views.get(node)
            if view is not None:
                return view.device_class
        record = self.state.nodes.get(node)
        return self._cache.get(record).device_class if record is not None else {}


def triage_model(
    out: Decisions,
    record: ModelRecord,
    replicas: list[ReplicaRecord],
    now: float,
    policy: Policy,
    lost_nodes: set[str],
    draining_nodes: set[str],
    shapes: ShapeCheck,
    known_draining: dict[str, float],
    unreachable_nodes: frozenset[str] = frozenset(),
    settled_nodes: frozenset[str] | None = None,
) -> ModelWork:
    """``settled_nodes``: nodes present and neither lost, unreachable nor
    draining; given, a model with nothing to do is answered by a shortcut."""
    if settled_nodes is not None:
        steady = steady_answer(out, record, replicas, now, shapes, settled_nodes)
        if steady is not None:
            return steady
    spec = record.spec
    # A model that still has a routable replica loses nothing by waiting for
    # an unreachable node to come back (REPLACE_AFTER_S keeps its replicas'
    # warm caches through a short outage); one with none is serving nobody,
    # so its replicas there are replaced now, make-before-break, wherever
    # there is room (if there is none, they stay and may yet come back).
    stranded = not any(shapes.state.routable(r, now) for r in replicas)
    failures, parked = record.failures, record.parked
    last_error, backoff_until = record.last_error, record.backoff_until
    by_node = NodeFailureBook(record.node_failures)
    if by_node:
        by_node.keep_only(shapes.state.nodes)
        # A start that succeeded on a node clears the failures there (the
        # node was repaired, or they were the model's own).
        for replica in replicas:
            if replica.state is ReplicaState.READY:
                for node in replica.nodes:
                    by_node.started(node, replica.created_at)

    # A start that succeeded after the last failure breaks the run of
    # consecutive failures; a replica that was ready all along does not (a
    # model whose every new start fails must still be parked).
    last_failure = backoff_until - policy.backoff(failures)
    if failures and any(
        r.state is ReplicaState.READY and r.created_at >= last_failure for r in replicas
    ):
        failures, backoff_until = 0, 0.0
        by_node.end_run()

    live: list[ReplicaRecord] = []
    moving: list[ReplicaRecord] = []
    counted = 0
    # This failure and the one before it ran out of the model's own memory
    # budget (see _should_park).
    over_budget_again = False
    for replica in replicas:
        failed_reason = _failure(replica, spec, now)
        if failed_reason is not None:
            out.removals.append(Removal(replica, "failed"))
            failures += 1
            counted += 1
            over_budget_again = memory.budget_failure(failed_reason) and (
                failures == 1 or memory.budget_failure(last_error)
            )
            last_error = failed_reason
            backoff_until = now + policy.backoff(failures)
            by_node.failed(replica.nodes, now)
            node = replica.nodes[0]
            here = by_node.entries[node].failures
            count = (
                f"failure {failures} of {policy.failure_limit}"
                if failures <= policy.failure_limit
                else f"failure {failures}, past the limit of {policy.failure_limit}"
            )
            out.event(
                "failed",
                spec.name,
                f"replica {replica.id} of {spec.name} failed on {', '.join(replica.nodes)}:"
                f" {failed_reason} ({count}; {here} on {node},"
                f" avoided there for {span(policy.node_backoff(here))})",
                replica=replica.id,
                failures=failures,
                node=node,
                node_failures=here,
            )
            continue
        gone = [n for n in replica.nodes if n in lost_nodes or n not in shapes.state.nodes]
        if gone:
            out.removals.append(Removal(replica, "replaced"))
            out.event(
                "replaced",
                spec.name,
                f"replica {replica.id} of {spec.name} lost with node {gone[0]}"
                f" (no report for more than {policy.replace_after_s:g} s); placing it elsewhere",
                replica=replica.id,
                node=gone[0],
            )
            continue
        if replica.draining:
            finish_drain(out, replica, now, policy, known_draining)
            continue
        if (
            any(n in draining_nodes for n in replica.nodes)
            or not shapes.fits(replica, spec)
            or (stranded and any(n in unreachable_nodes for n in replica.nodes))
        ):
            moving.append(replica)
        else:
            live.append(replica)

    # Only a pass that counted a failure may park: deciding costs a look at
    # the fleet (nodes_that_fit), which a model waiting out its backoff must
    # not pay every pass.
    run_nodes = by_node.run_nodes()
    # Running out of the model's memory budget is the model's own doing
    # (its memory_mib, its context) wherever it runs: those failures park it
    # after the limit even on one node, where a node's fault would not.
    if (
        counted
        and not parked
        and (
            (over_budget_again and failures >= policy.failure_limit)
            or _should_park(failures, run_nodes, spec, policy, shapes, now)
        )
    ):
        parked = True
        out.event(
            "parked",
            spec.name,
            f"{spec.name} parked after {failures} consecutive failed starts"
            f" on {_nodes_phrase(run_nodes)}; last error: {last_error}",
            failures=failures,
            last_error=last_error,
            nodes=len(run_nodes),
        )
    if by_node.changed or (failures, parked, last_error, backoff_until) != (
        record.failures,
        record.parked,
        record.last_error,
        record.backoff_until,
    ):
        out.models[spec.name] = ModelUpdate(
            spec.name, failures, parked, last_error, backoff_until, by_node.entries
        )

    desired = desired_count(record, live + moving, now)
    outcome = ModelOutcome(spec.name, desired)
    out.outcomes[spec.name] = outcome
    if by_node:
        outcome.avoided = by_node.avoided(now, policy.node_backoff)

    # Extras go idle-first: the replica nobody is using costs nothing to stop.
    if len(live) > desired:
        order = sorted(live, key=lambda r: retire_order(r, now))
        for replica in order[: len(live) - desired]:
            idle = idle_for(replica, now)
            kind = (
                "unloaded"
                if spec.on_demand and desired == 0 and idle >= spec.idle_timeout_s
                else "scaled-down"
            )
            retire(out, replica, kind, f"idle for {idle:.0f} s", now)
        keep = {r.id for r in order[len(live) - desired :]}
        live = [r for r in live if r.id in keep]

    # Make-before-break: a replica leaving a draining node (or one whose
    # entry changed shape) is marked draining only once a ready replica
    # elsewhere has taken its seat.
    ready_live = sum(1 for r in live if r.state is ReplicaState.READY)
    can_retire = max(0, min(len(moving), ready_live + len(moving) - desired))
    for replica in sorted(moving, key=lambda r: retire_order(r, now))[:can_retire]:
        retire(out, replica, "drained", "its replacement is ready", now, always_drain=True)
    outcome.kept = live
    outcome.moving = moving

    to_place = max(0, desired - len(live))
    if to_place and parked:
        outcome.status = PARKED
        outcome.reason = f"parked after {failures} failed starts; last error: {last_error}"
        to_place = 0
    elif to_place and backoff_until > now:
        outcome.status = BACKING_OFF
        outcome.reason = (
            f"retrying after {failures} failed start{'s' if failures != 1 else ''}"
            f" in {backoff_until - now:.0f} s; last error: {last_error}"
        )
        if failures >= policy.failure_limit and run_nodes:
            outcome.reason += (
                f"; not parked: it failed on {_nodes_phrase(run_nodes)} only,"
                " and other nodes can take it"
            )
        to_place = 0
    return ModelWork(record, outcome, to_place, [r.id for r in moving])


def steady_answer(
    out: Decisions,
    record: ModelRecord,
    replicas: list[ReplicaRecord],
    now: float,
    shapes: ShapeCheck,
    settled_nodes: frozenset[str],
) -> ModelWork | None:
    """What ``triage_model`` answers for a model with nothing to triage, or None.

    Nothing to triage: no failures counted, not parked, every replica ready
    or starting within its timeout, of the entry's shape, on nodes that are
    neither lost, unreachable nor draining, and no more of them than it
    should have. That is nearly every model of a steady fleet, and the full
    path's bookkeeping for each of 5,000 of them was most of a 10,000-node
    pass. The answer is the full path's under those conditions: nothing
    removed, no event, no model update, the replicas kept, and what is short
    left to place unless backing off (which the full path words).
    tests/control/scheduler/test_sched_properties.py runs both on random
    fleets and expects the same decisions.
    """
    if record.failures or record.parked or record.node_failures:
        return None
    spec = record.spec
    timeout = spec.start_timeout_s
    for replica in replicas:
        state = replica.state
        if state is ReplicaState.STARTING:
            if now - replica.created_at > timeout:
                return None
        elif state is not ReplicaState.READY:
            return None
        if not shapes.fits(replica, spec, settled_nodes):
            return None
    desired = desired_count(record, replicas, now)
    to_place = desired - len(replicas)
    if to_place < 0 or (to_place and record.backoff_until > now):
        return None
    outcome = ModelOutcome(spec.name, desired)
    outcome.kept = list(replicas)
    out.outcomes[spec.name] = outcome
    return ModelWork(record, outcome, to_place, [])


def _should_park(
    failures: int,
    run_nodes: list[str],
    spec: ModelSpec,
    policy: Policy,
    shapes: ShapeCheck,
    now: float,
) -> bool:
    """Park after ``failure_limit`` consecutive failures that hit several nodes.

    Several: ``park_min_nodes`` distinct nodes (2 by default), or every
    ready node that can hold the model when there are fewer (a one-node
    fleet parks as it always did). A multi-node replica's failure counts on
    all the nodes it spans, so it needs one node more than it spans: two
    different placements. Failures that all hit one node while other nodes
    could take the model point at the node, not the model: it keeps being
    retried (elsewhere first, see node_failures.py) at the model's backoff.
    """
    if failures < policy.failure_limit:
        return False
    needed = max(1, policy.park_min_nodes + spec.nodes - 1)
    if len(run_nodes) >= needed:
        return True
    return len(run_nodes) >= shapes.nodes_that_fit(spec, now, at_most=needed)


def _nodes_phrase(nodes: list[str]) -> str:
    if len(nodes) == 1:
        return f"1 node ({nodes[0]})"
    shown = ", ".join(nodes[:5]) + (", ..." if len(nodes) > 5 else "")
    return f"{len(nodes)} nodes ({shown})"


def _failure(replica: ReplicaRecord, spec: ModelSpec, now: float) -> str | None:
    # A replica that was being stopped anyway is not a failed start.
    if replica.draining:
        return None
    if replica.state is ReplicaState.FAILED:
        return replica.reason or "the engine failed"
    if replica.state is ReplicaState.STARTING and now - replica.created_at > spec.start_timeout_s:
        return f"not ready within its start timeout of {spec.start_timeout_s:g} s"
    return None
