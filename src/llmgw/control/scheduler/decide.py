"""One reconcile pass: state in, decisions out, nothing changed.

``Scheduler.decide`` reads FleetState and returns what should change (replicas to
create, remove or mark draining, model failure counts, events) without
changing anything. The reconciler writes the decisions to the store and only
then applies them to memory, so a write refused by the store (a deposed
leader) leaves memory as it was; the planner runs the very same function and
shows the decisions instead, which is why the two cannot disagree.

Order inside a pass: first every removal (failed, lost, extra, drained), so
their devices are free for this pass's placements (triage.py); then
placements (shortfall.py), always-on models before on-demand ones and larger
shapes before smaller ones (best-fit decreasing leaves less stranded
capacity than arrival order). The knobs and the answer are in decisions.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter

from llmgw.control import state as state_module
from llmgw.control.scheduler.decisions import Decisions, ModelWork, Policy, Removal
from llmgw.control.scheduler.eviction import evictable_replicas
from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.keeper import SnapshotKeeper
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.placementnode import DeviceCache
from llmgw.control.scheduler.shapecheck import ShapeCheck
from llmgw.control.scheduler.shortfall import place_shortfall
from llmgw.control.scheduler.snapshot import build_snapshot
from llmgw.control.scheduler.triage import TriagePass, steady_answer, triage_model
from llmgw.control.scheduler.triagememo import TriageMemo
from llmgw.control.state import FleetState
from llmgw.wire import NodeState


class Scheduler:
    """The scheduler of one control plane: its policy and placer, and what it keeps
    from one pass to the next.

    What it keeps -- the fleet's placement snapshot (keeper.py) and steady
    models' answers (triagememo.py) -- makes a pass over a fleet that hardly
    changed cost what changed; the decisions are those of a pass from
    scratch, which ``remember=False`` makes every time (the planner's dry
    runs, one-off decisions in tests and benchmarks).
    """

    # Steady models answered without the full bookkeeping
    # (triage.steady_answer). Turned off only by the tests that check it
    # changes no decision.
    shortcut = True

    def __init__(
        self,
        policy: Policy | None = None,
        placer: Placer | None = None,
        *,
        remember: bool = True,
    ) -> None:
        self.policy = policy or Policy()
        self.placer = placer or Placer()
        self.keeper = SnapshotKeeper() if remember else None
        self.memo = TriageMemo() if remember else None

    def decide(
        self,
        state: FleetState,
        now: float,
        draining_since: Mapping[str, float] | None = None,
        *,
        with_snapshot: bool = False,
    ) -> Decisions:
        """One pass: what should change, nothing changed. ``draining_since``: when
        each draining replica was first seen draining; ``with_snapshot``: keep the
        placement snapshot in the answer even when nothing was placed (the planner)."""
        return _decide(self, state, now, draining_since or {}, with_snapshot)


def decide(
    state: FleetState, now: float, policy: Policy | None = None, *, placer: Placer | None = None
) -> Decisions:
    """One pass from scratch, keeping nothing (tests, benchmarks, one-off answers)."""
    return Scheduler(policy, placer, remember=False).decide(state, now)


def _decide(
    scheduler: Scheduler,
    state: FleetState,
    now: float,
    draining_since: Mapping[str, float],
    with_snapshot: bool,
) -> Decisions:
    policy, placer, keeper = scheduler.policy, scheduler.placer, scheduler.keeper
    cache = keeper.devices if keeper is not None else DeviceCache()
    out = Decisions(now=now)
    known_draining = dict(draining_since)

    # One sweep over the nodes for all four sets and every node's state (the
    # keeper reads them too): 10,000 nodes, every pass.
    lost_nodes: set[str] = set()
    unreachable: set[str] = set()
    draining_nodes: set[str] = set()
    settled_nodes: list[str] = []
    node_states: dict[str, NodeState] = {}
    replace_after = policy.replace_after_s
    # A node silent past the replacement grace is past the unreachable one
    # too, unless a policy makes the first the shorter.
    lost_only_if_unreachable = replace_after >= state_module.UNREACHABLE_AFTER_S
    for name, node in state.nodes.items():
        node_state = node_states[name] = node.state(now)
        if node_state is NodeState.UNREACHABLE:
            unreachable.add(name)
            if node.silent_for(now) > replace_after:
                lost_nodes.add(name)
        elif not lost_only_if_unreachable and node.silent_for(now) > replace_after:
            lost_nodes.add(name)
        elif node_state is not NodeState.DRAINING:
            settled_nodes.append(name)
        if node.admin_state is NodeState.DRAINING:
            draining_nodes.add(name)
    unreachable_nodes = frozenset(unreachable)
    settled = frozenset(settled_nodes)

    # Replicas of models no longer in the catalog.
    for model in sorted(set(state.replicas.models()) - set(state.models)):
        for replica in sorted(state.replicas.of_model(model), key=_BY_ID):
            out.removals.append(Removal(replica, "orphaned"))
            out.event(
                "removed", replica.id, f"removed replica {replica.id}: model {model!r} was deleted"
            )

    work: list[ModelWork] = []
    # The kept snapshot first: its views give each node's device classes to
    # the shape check without a lookup of the node's digested inventory.
    base = keeper.refresh(state, now, node_states) if keeper is not None else None
    shapes = ShapeCheck(state, cache, base.nodes if base is not None else None)
    triaging = TriagePass(
        out, now, policy, shapes, lost_nodes, draining_nodes, unreachable_nodes, known_draining
    )
    # Steady models' answers from earlier passes, while they hold (triagememo.py).
    shortcut = scheduler.shortcut
    memo = scheduler.memo if shortcut else None
    if memo is not None and keeper is not None:
        memo.begin(state, settled, keeper.changed_nodes)
    for name in sorted(state.models):
        record = state.models[name]
        kept = memo.get(record) if memo is not None else None
        if kept is not None:
            out.outcomes[name] = kept.outcome
            work.append(kept)
            continue
        replicas = list(state.replicas.of_model(name))
        if len(replicas) > 1:
            replicas.sort(key=_BY_ID)
        item = steady_answer(out, record, replicas, now, shapes, settled) if shortcut else None
        if item is not None:
            if memo is not None:
                memo.keep(record, replicas, item)
        else:
            item = triage_model(triaging, record, replicas)
        work.append(item)

    pending = [w for w in work if w.to_place > 0]
    if pending or with_snapshot:
        removed = [r.replica.id for r in out.removals]
        if keeper is not None:
            out.snapshot = keeper.fork(state, now, exclude=removed)
        else:
            out.snapshot = build_snapshot(state, now, exclude=removed, cache=cache)
    if pending and out.snapshot is not None:
        evictable = evictable_replicas(state, out, now, policy)
        pending.sort(key=lambda w: (w.record.spec.on_demand, -w.record.spec.gpus, w.record.name))
        failed_shapes: set[Request] = set()
        for item in pending:
            place_shortfall(out, out.snapshot, placer, item, evictable, failed_shapes)
    for item in work:
        record = item.record
        reason = item.outcome.reason if item.outcome.unplaceable is not None else None
        out.reasons[record.name] = reason
        if reason is not None and reason != record.unplaceable_reason:
            out.event("unplaceable", record.name, f"{record.name}: {item.outcome.status}: {reason}")
    return out


_BY_ID = attrgetter("id")

__all__ = ["Scheduler", "decide"]
