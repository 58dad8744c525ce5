"""Phase one of a pass: sort each model's replicas, count failures, decide removals.

For one model at a time (``ModelTriage``, its steps in the order they run):
failed starts are counted, against the model and against the nodes they
ran on (node_failures.py), and the model is parked after too many on too
many nodes (``_park``); replicas on lost nodes are replaced, drains are
finished, replicas on a draining node or of an outdated shape are moved
make-before-break, extras are retired, and what is still missing is left
for phase two to place (shortfall.py). Models with nothing to triage are
answered by ``steady_answer`` instead, without the bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from llmgw.control.scheduler.node_failures import NodeFailureBook, span
from llmgw.control.scheduler.retire import finish_drain, retire, retire_order
from llmgw.control.scheduler.shapecheck import ShapeCheck
from llmgw.control.state import ModelRecord, ReplicaRecord
from llmgw.wire import ModelSpec, ReplicaState


@dataclass(frozen=True, slots=True)
class TriagePass:
    """What every model's triage in one pass shares: the pass's answer being
    built, its clock and knobs, and the node sets decide sorted once."""

    out: Decisions
    now: float
    policy: Policy
    shapes: ShapeCheck
    lost_nodes: set[str]
    draining_nodes: set[str]
    unreachable_nodes: frozenset[str]
    # replica id -> when the reconciler first saw it draining.
    known_draining: dict[str, float]


def triage_model(run: TriagePass, record: ModelRecord, replicas: list[ReplicaRecord]) -> ModelWork:
    """One model's removals, failure bookkeeping and what is left to place."""
    return ModelTriage(run, record, replicas).run()


class ModelTriage:
    """One model's triage: its failure bookkeeping as it is being rewritten
    and its replicas as they are being sorted, read and written by the steps
    of ``run`` in turn."""

    def __init__(self, run: TriagePass, record: ModelRecord, replicas: list[ReplicaRecord]) -> None:
        self.p = run
        self.record = record
        self.spec = record.spec
        self.replicas = replicas
        self.failures, self.parked = record.failures, record.parked
        self.last_error, self.backoff_until = record.last_error, record.backoff_until
        self.by_node = NodeFailureBook(record.node_failures)
        # Failures this pass counted; only a pass that counted one may park.
        self.counted = 0
        # This failure and the one before it ran out of the model's own
        # memory budget (see _park).
        self.over_budget_again = False
        self.live: list[ReplicaRecord] = []
        self.moving: list[ReplicaRecord] = []

    def run(self) -> ModelWork:
        self._end_run_on_success()
        self._sort_replicas()
        run_nodes = self.by_node.run_nodes()
        self._park(run_nodes)
        self._record_update()
        outcome = self._outcome()
        self._retire_extras(outcome.desired)
        self._retire_moved(outcome.desired)
        outcome.kept = self.live
        outcome.moving = self.moving
        to_place = self._to_place(outcome, run_nodes)
        return ModelWork(self.record, outcome, to_place, [r.id for r in self.moving])

    def _end_run_on_success(self) -> None:
        by_node, policy = self.by_node, self.p.policy
        if by_node:
            by_node.keep_only(self.p.shapes.state.nodes)
            # A start that succeeded on a node clears the failures there (the
            # node was repaired, or they were the model's own).
            for replica in self.replicas:
                if replica.state is ReplicaState.READY:
                    for node in replica.nodes:
                        by_node.started(node, replica.created_at)
        # A start that succeeded after the last failure breaks the run of
        # consecutive failures; a replica that was ready all along does not
        # (a model whose every new start fails must still be parked).
        last_failure = self.backoff_until - policy.backoff(self.failures)
        if self.failures and any(
            r.state is ReplicaState.READY and r.created_at >= last_failure for r in self.replicas
        ):
            self.failures, self.backoff_until = 0, 0.0
            by_node.end_run()

    def _sort_replicas(self) -> None:
        """Failed and lost replicas removed, drains finished, the rest kept or moving."""
        p, spec = self.p, self.spec
        # A model that still has a routable replica loses nothing by waiting
        # for an unreachable node to come back (REPLACE_AFTER_S keeps its
        # replicas' warm caches through a short outage); one with none is
        # serving nobody, so its replicas there are replaced now,
        # make-before-break, wherever there is room (if there is none, they
        # stay and may yet come back).
        stranded = not any(p.shapes.state.routable(r, p.now) for r in self.replicas)
        nodes = p.shapes.state.nodes
        for replica in self.replicas:
            failed_reason = _failure(replica, spec, p.now)
            if failed_reason is not None:
                self._count_failure(replica, failed_reason)
                continue
            gone = [n for n in replica.nodes if n in p.lost_nodes or n not in nodes]
            if gone:
                p.out.removals.append(Removal(replica, "replaced"))
                p.out.event(
                    "replaced",
                    spec.name,
                    f"replica {replica.id} of {spec.name} lost with node {gone[0]}"
                    f" (no report for more than {p.policy.replace_after_s:g} s);"
                    " placing it elsewhere",
                    replica=replica.id,
                    node=gone[0],
                )
                continue
            if replica.draining:
                finish_drain(p.out, replica, p.now, p.policy, p.known_draining)
                continue
            if (
                any(n in p.draining_nodes for n in replica.nodes)
                or not p.shapes.fits(replica, spec)
                or (stranded and any(n in p.unreachable_nodes for n in replica.nodes))
            ):
                self.moving.append(replica)
            else:
                self.live.append(replica)

    def _count_failure(self, replica: ReplicaRecord, reason: str) -> None:
        p, policy, name = self.p, self.p.policy, self.spec.name
        p.out.removals.append(Removal(replica, "failed"))
        self.failures += 1
        self.counted += 1
        failures = self.failures
        self.over_budget_again = memory.budget_failure(reason) and (
            failures == 1 or memory.budget_failure(self.last_error)
        )
        self.last_error = reason
        self.backoff_until = p.now + policy.backoff(failures)
        self.by_node.failed(replica.nodes, p.now)
        node = replica.nodes[0]
        here = self.by_node.entries[node].failures
        count = (
            f"failure {failures} of {policy.failure_limit}"
            if failures <= policy.failure_limit
            else f"failure {failures}, past the limit of {policy.failure_limit}"
        )
        p.out.event(
            "failed",
            name,
            f"replica {replica.id} of {name} failed on {', '.join(replica.nodes)}:"
            f" {reason} ({count}; {here} on {node},"
            f" avoided there for {span(policy.node_backoff(here))})",
            replica=replica.id,
            failures=failures,
            node=node,
            node_failures=here,
        )

    def _park(self, run_nodes: list[str]) -> None:
        # Only a pass that counted a failure may park: deciding costs a look
        # at the fleet (nodes_that_fit), which a model waiting out its
        # backoff must not pay every pass. Running out of the model's memory
        # budget is the model's own doing (its memory_mib, its context)
        # wherever it runs: those failures park it after the limit even on
        # one node, where a node's fault would not.
        if not self.counted or self.parked:
            return
        if not (
            (self.over_budget_again and self.failures >= self.p.policy.failure_limit)
            or self._failed_on_enough_nodes(run_nodes)
        ):
            return
        self.parked = True
        name = self.spec.name
        self.p.out.event(
            "parked",
            name,
            f"{name} parked after {self.failures} consecutive failed starts"
            f" on {_nodes_phrase(run_nodes)}; last error: {self.last_error}",
            failures=self.failures,
            last_error=self.last_error,
            nodes=len(run_nodes),
        )

    def _failed_on_enough_nodes(self, run_nodes: list[str]) -> bool:
        """Park after ``failure_limit`` consecutive failures that hit several nodes.

        Several: ``park_min_nodes`` distinct nodes (2 by default), or every
        ready node that can hold the model when there are fewer (a one-node
        fleet parks as it always did). A multi-node replica's failure counts
        on all the nodes it spans, so it needs one node more than it spans:
        two different placements. Failures that all hit one node while other
        nodes could take the model point at the node, not the model: it
        keeps being retried (elsewhere first, see node_failures.py) at the
        model's backoff.
        """
        policy, spec = self.p.policy, self.spec
        if self.failures < policy.failure_limit:
            return False
        needed = max(1, policy.park_min_nodes + spec.nodes - 1)
        if len(run_nodes) >= needed:
            return True
        return len(run_nodes) >= self.p.shapes.nodes_that_fit(spec, self.p.now, at_most=needed)

    def _record_update(self) -> None:
        """The model's bookkeeping, persisted only when this pass changed it."""
        record = self.record
        now_values = (self.failures, self.parked, self.last_error, self.backoff_until)
        before = (record.failures, record.parked, record.last_error, record.backoff_until)
        if self.by_node.changed or now_values != before:
            self.p.out.models[self.spec.name] = ModelUpdate(
                self.spec.name, *now_values, self.by_node.entries
            )

    def _outcome(self) -> ModelOutcome:
        p, name = self.p, self.spec.name
        desired = desired_count(self.record, self.live + self.moving, p.now)
        outcome = p.out.outcomes[name] = ModelOutcome(name, desired)
        if self.by_node:
            outcome.avoided = self.by_node.avoided(p.now, p.policy.node_backoff)
        return outcome

    def _retire_extras(self, desired: int) -> None:
        # Extras go idle-first: the replica nobody is using costs nothing to stop.
        # A sleeping replica (control.sleep) is not retired for being idle:
        # sleeping instead of stopping is the point; eviction takes it when
        # its devices are wanted.
        live, now, spec = self.live, self.p.now, self.spec
        if len(live) <= desired:
            return
        order = sorted((r for r in live if not r.asleep), key=lambda r: retire_order(r, now))
        extra = min(len(order), len(live) - desired)
        for replica in order[:extra]:
            idle = idle_for(replica, now)
            kind = (
                "unloaded"
                if spec.on_demand and desired == 0 and idle >= spec.idle_timeout_s
                else "scaled-down"
            )
            retire(self.p.out, replica, kind, f"idle for {idle:.0f} s", now)
        gone = {r.id for r in order[:extra]}
        self.live = [r for r in live if r.id not in gone]

    def _retire_moved(self, desired: int) -> None:
        # Make-before-break: a replica leaving a draining node (or one whose
        # entry changed shape) is marked draining only once a ready replica
        # elsewhere has taken its seat.
        moving, now = self.moving, self.p.now
        ready_live = sum(1 for r in self.live if r.state is ReplicaState.READY)
        can_retire = max(0, min(len(moving), ready_live + len(moving) - desired))
        for replica in sorted(moving, key=lambda r: retire_order(r, now))[:can_retire]:
            retire(
                self.p.out, replica, "drained", "its replacement is ready", now, always_drain=True
            )

    def _to_place(self, outcome: ModelOutcome, run_nodes: list[str]) -> int:
        """What is missing, unless the model is parked or backing off (then why not)."""
        to_place = max(0, outcome.desired - len(self.live))
        failures, last_error, now = self.failures, self.last_error, self.p.now
        if to_place and self.parked:
            outcome.status = PARKED
            outcome.reason = f"parked after {failures} failed starts; last error: {last_error}"
            return 0
        if to_place and self.backoff_until > now:
            outcome.status = BACKING_OFF
            outcome.reason = (
                f"retrying after {failures} failed start{'s' if failures != 1 else ''}"
                f" in {self.backoff_until - now:.0f} s; last error: {last_error}"
            )
            if failures >= self.p.policy.failure_limit and run_nodes:
                outcome.reason += (
                    f"; not parked: it failed on {_nodes_phrase(run_nodes)} only,"
                    " and other nodes can take it"
                )
            return 0
        return to_place


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
