"""Stopping replicas: which go first, draining the serving ones, and ending a drain."""

from __future__ import annotations

from llmgw.control.scheduler.decisions import Decisions, Policy, Removal
from llmgw.control.scheduler.demand import idle_for
from llmgw.control.state import ReplicaRecord
from llmgw.wire import ReplicaState


def retire_order(replica: ReplicaRecord, now: float) -> tuple[int, float, str]:
    # Not serving first (starting replicas hold no cache yet), then idle
    # longest first; the id makes the order total, so the planner and the
    # reconciler pick the same replica.
    serving = replica.state is ReplicaState.READY
    return (1 if serving else 0, -idle_for(replica, now), replica.id)


def retire(
    out: Decisions,
    replica: ReplicaRecord,
    kind: str,
    why: str,
    now: float,
    *,
    always_drain: bool = False,
) -> None:
    """Stop a replica: a serving one through draining, any other at once."""
    serving = replica.state is ReplicaState.READY
    if serving and (always_drain or replica.in_flight > 0):
        out.mark_draining.append(replica)
        out.draining_since[replica.id] = now
        out.event(
            "drain",
            replica.model,
            f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)}"
            f" is draining ({kind}: {why})",
            replica=replica.id,
            step="draining",
        )
        return
    out.removals.append(Removal(replica, kind))
    out.event(
        kind,
        replica.model,
        f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)} removed"
        f" ({kind}: {why})",
        replica=replica.id,
    )


def finish_drain(
    out: Decisions,
    replica: ReplicaRecord,
    now: float,
    policy: Policy,
    known: dict[str, float],
) -> None:
    """Remove a draining replica once it is idle past the grace, or waited too long."""
    since = known.get(replica.id)
    if since is None:
        # Marked by an earlier leader, or before a restart: start the clock.
        out.draining_since[replica.id] = now
        since = now
    waited = now - since
    if (
        replica.state is ReplicaState.FAILED
        or (replica.in_flight == 0 and waited >= policy.drain_grace_s)
        or waited >= policy.drain_timeout_s
    ):
        out.removals.append(Removal(replica, "drained"))
        out.event(
            "drain",
            replica.model,
            f"replica {replica.id} of {replica.model} on {', '.join(replica.nodes)} removed"
            f" after draining for {waited:.0f} s",
            replica=replica.id,
            step="removed",
        )
