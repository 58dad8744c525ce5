"""What the scheduler's tests do to a fleet between passes, in one place."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from llmgw.control.scheduler.decide import decide
from llmgw.control.scheduler.decisions import Decisions, Policy
from llmgw.control.state import FleetState
from llmgw.wire import ReplicaState


def passes_settings(max_examples: int) -> settings:
    """Hypothesis settings for tests that run several passes over a drawn fleet."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def apply(state: FleetState, decisions: Decisions) -> None:
    """What the reconciler writes of a pass, done to the state in memory."""
    for removal in decisions.removals:
        state.replicas.pop(removal.replica.id, None)
    for replica in decisions.mark_draining:
        state.replicas[replica.id].move_to(ReplicaState.DRAINING)
    for replica in decisions.new:
        state.replicas[replica.id] = replica
    for name, update in decisions.models.items():
        record = state.models[name]
        record.failures, record.parked = update.failures, update.parked
        record.last_error, record.backoff_until = update.last_error, update.backoff_until
        record.node_failures = update.node_failures


def fail_starts(state: FleetState, policy: Policy, passes: int, now: float,
                reason: str = "exit code 1") -> tuple[list[str], float]:
    """Each pass (its nodes just heard from), every starting replica fails with ``reason``.

    Returns the events of all passes and the time after the last one.
    """
    events: list[str] = []
    for _ in range(passes):
        for replica in state.replicas.values():
            if replica.state is ReplicaState.STARTING:
                replica.state, replica.reason = ReplicaState.FAILED, reason
        for node in state.nodes.values():
            node.last_seen = now
        decisions = decide(state, now, policy)
        events += [f"{e.kind}: {e.message}" for e in decisions.events]
        assert all(r.replica.id in state.replicas for r in decisions.removals)
        apply(state, decisions)
        now += 1.0
    return events, now
