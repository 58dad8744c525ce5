"""The reconciler: one pass = decide, write to the store, then apply to memory.

The decisions come from ``Scheduler.decide`` (changes nothing; shared with the
planner). Writing before applying is what keeps memory honest when the write
is refused: a deposed leader's pass raises NotLeaderError from the store and
leaves FleetState exactly as it was, instead of holding replicas no store
row backs. Changes are applied field by field to the live records rather
than by replacing them, because agent reports keep updating those records
while the write is in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from llmgw.control.adapters import AdapterPlan, plan_adapters
from llmgw.control.gcpause import freeze_burst, paused_gc
from llmgw.control.rows import event_row, model_row, node_failures_json, replica_row
from llmgw.control.scheduler.decide import Scheduler
from llmgw.control.scheduler.decisions import Decisions, Policy
from llmgw.control.scheduler.placement import Placer
from llmgw.control.sleep import apply_sleep, plan_sleep
from llmgw.control.state import FleetState, ModelRecord
from llmgw.control.store.repo import Store
from llmgw.control.writes import FencedWrites
from llmgw.errors import NotFoundError
from llmgw.wire import Event, ReplicaState

Row = dict[str, Any]

# A pass writing more rows than this leaves the collector a heap of new
# objects (replicas, rows, events) to walk again and again while the store's
# driver allocates per row (see gcpause.freeze_burst).
_FREEZE_AFTER = 1000


@dataclass(slots=True)
class PassResult:
    """What one pass did: the loop's log line, the control plane's metrics
    (llmgw.control.counters) and tests read it."""

    # Replicas placed by why (short of its count, or moving one) and removed
    # by kind (Removal.kind); the totals are read off these, so the two can
    # never disagree.
    placed_by: dict[str, int] = field(default_factory=dict)
    removed_by: dict[str, int] = field(default_factory=dict)
    draining: int = 0
    parked: int = 0
    unplaceable: int = 0
    events: list[Event] = field(default_factory=list)
    duration_s: float = 0.0
    changed: bool = False

    @property
    def placed(self) -> int:
        return sum(self.placed_by.values())

    @property
    def removed(self) -> int:
        return sum(self.removed_by.values())

    @property
    def failed(self) -> int:
        return self.removed_by.get("failed", 0)

    @property
    def evicted(self) -> int:
        return self.removed_by.get("evicted", 0)


class Reconciler:
    def __init__(
        self,
        state: FleetState,
        # Where a pass is written: the runtime's fenced path, or a Store
        # itself (tests, benchmarks: one instance, no election).
        store: Store | FencedWrites,
        *,
        policy: Policy | None = None,
        placer: Placer | None = None,
    ) -> None:
        self.state = state
        self.store = store
        # The policy is the control plane's (ControlPlane.policy), which the
        # admin plan reads too: a plan with other knobs would predict other
        # parking. The scheduler keeps its snapshot between passes.
        self.scheduler = Scheduler(policy, placer)
        self.last_pass: PassResult | None = None
        self.last_adapters: AdapterPlan | None = None
        # When each draining replica was first seen draining (memory only; a
        # new leader restarts the clock, which only delays removal).
        self._draining_since: dict[str, float] = {}
        # Two overlapping passes would each place the same missing replica.
        self._lock = asyncio.Lock()

    async def run_pass(self, now: float, epoch: int) -> PassResult:
        async with self._lock:
            started = time.perf_counter()
            # Before the pass: its triage keeps the replicas now asleep.
            slept = apply_sleep(plan_sleep(self.state, now), now)
            with paused_gc():
                decisions = self.scheduler.decide(self.state, now, self._draining_since)
                rows = [replica_row(r) for r in decisions.new] + [
                    replica_row(r, draining=True) for r in decisions.mark_draining
                ]
                events = [event_row(e) for e in decisions.events]
                models = self._model_rows(decisions, now)
                # What only the planner reads (an outcome per model, the
                # pass's snapshot) goes now, freed by reference counting while
                # the collector is still paused, instead of being walked by
                # the collections the rest of the pass sets off: at 5,000
                # models that walk was a tenth of a steady pass.
                decisions.outcomes.clear()
                decisions.snapshot = None
                if len(rows) + len(events) > _FREEZE_AFTER:
                    freeze_burst()
            # One fenced transaction for the whole pass: replicas, models and
            # events land together or not at all, and memory changes only after.
            await self.store.write_replicas(
                rows,
                [removal.replica.id for removal in decisions.removals],
                epoch=epoch,
                events=events,
                models=models,
            )
            self._apply_replicas(decisions)
            self._apply_models(decisions)
            adapters = plan_adapters(self.state, now)
            for replica_id, loaded in adapters.changes.items():
                replica = self.state.replicas.get(replica_id)
                if replica is not None:
                    replica.adapters = loaded
            self.last_adapters = adapters
            if decisions.changes_replicas or adapters.changes or slept:
                await self.state.bump_routing()
            result = _result(decisions, time.perf_counter() - started)
            self.last_pass = result
            return result

    # -- applying to memory (after the store accepted the write) ----------------

    def _apply_replicas(self, decisions: Decisions) -> None:
        replicas = self.state.replicas
        for removal in decisions.removals:
            replicas.pop(removal.replica.id, None)
            self._draining_since.pop(removal.replica.id, None)
        for replica in decisions.mark_draining:
            live = replicas.get(replica.id)
            # A report may have failed it while the write was in flight.
            if live is not None and live.can_move_to(ReplicaState.DRAINING):
                live.move_to(ReplicaState.DRAINING, live.reason)
        for replica in decisions.new:
            replicas[replica.id] = replica
        for replica_id, since in decisions.draining_since.items():
            if replica_id in replicas:
                self._draining_since.setdefault(replica_id, since)
        for name, reason in decisions.reasons.items():
            record = self.state.models.get(name)
            if record is not None:
                record.unplaceable_reason = reason

    def _model_rows(self, decisions: Decisions, now: float) -> list[Row]:
        rows = []
        for name, update in sorted(decisions.models.items()):
            record = self.state.models.get(name)
            if record is None:
                continue
            row = model_row(record, updated_at=now)
            row.update(
                parked=update.parked,
                failures=update.failures,
                last_error=update.last_error,
                node_failures=node_failures_json(update.node_failures),
            )
            rows.append(row)
        return rows

    def _apply_models(self, decisions: Decisions) -> None:
        for name, update in decisions.models.items():
            record = self.state.models.get(name)
            if record is None:
                continue
            record.failures = update.failures
            record.parked = update.parked
            record.last_error = update.last_error
            record.backoff_until = update.backoff_until
            record.node_failures = update.node_failures


def _result(decisions: Decisions, duration_s: float) -> PassResult:
    kinds = [r.kind for r in decisions.removals]
    moves = sum(1 for e in decisions.events if e.kind == "placed" and e.data.get("replaces"))
    placed_by = {"move": moves, "short": len(decisions.new) - moves}
    return PassResult(
        placed_by={reason: n for reason, n in placed_by.items() if n},
        removed_by=dict(Counter(kinds)),
        draining=len(decisions.mark_draining),
        parked=sum(1 for e in decisions.events if e.kind == "parked"),
        unplaceable=sum(1 for r in decisions.reasons.values() if r is not None),
        events=list(decisions.events),
        duration_s=duration_s,
        changed=decisions.changes_replicas or bool(decisions.models),
    )


# ---------------------------------------------------------------------------
# Unpark
# ---------------------------------------------------------------------------


def unpark(state: FleetState, name: str) -> ModelRecord:
    """Let a parked model be retried: clears parked, failures and backoff.

    Failures by node go too: an operator who unparks has usually fixed the
    model or the nodes, and a node still avoided for an hour would make the
    first retries go elsewhere for no reason. Memory only; the caller
    persists ``model_row(record)`` (fenced) and writes an event. The last
    error is kept as history: it says why the model was parked until a new
    failure or a successful start replaces it.
    """
    record = state.resolve_model(name)
    if record is None:
        raise NotFoundError(f"no model named {name!r}")
    record.parked = False
    record.failures = 0
    record.backoff_until = 0.0
    record.node_failures = {}
    record.unplaceable_reason = None
    return record
