"""The shortcut for models with nothing to triage decides exactly what the full path does,
and so do its answers kept from pass to pass (scheduler/triagememo.py).

Random fleets and catalogs move between passes as in test_sched_properties
(replicas become ready or fail, nodes are cordoned or drained), with the
clock moving too (start timeouts, idle on-demand replicas, unreachable
nodes); every pass is decided twice, with and without the shortcut.
"""

from __future__ import annotations

import itertools
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.control.scheduler.schedkit import apply, passes_settings
from tests.control.scheduler.test_sched_properties import NOW, fleets

from llmgw.control.scheduler.decide import Scheduler, decide
from llmgw.control.scheduler.decisions import Decisions, Policy
from llmgw.control.state import FleetState
from llmgw.sim.fleetgen import generate
from llmgw.wire import NodeState, ReplicaState


def full_path(policy: Policy | None = None) -> Scheduler:
    """A scheduler that triages every model, steady or not, and keeps nothing."""
    scheduler = Scheduler(policy, remember=False)
    scheduler.shortcut = False
    return scheduler


def essence(decisions: Decisions) -> object:
    return (
        [(r.id, r.model, [(s.node, s.device_numbers) for s in r.shards]) for r in decisions.new],
        [(r.replica.id, r.kind) for r in decisions.removals],
        [r.id for r in decisions.mark_draining],
        {n: (u.failures, u.parked, u.last_error, u.backoff_until, u.node_failures)
         for n, u in decisions.models.items()},
        decisions.reasons,
        [(e.kind, e.subject, e.message, e.data) for e in decisions.events],
        {n: (o.desired, [r.id for r in o.kept], [r.id for r in o.moving], o.status, o.reason,
             [r.id for r, _ in o.placed], o.avoided, o.used_anyway)
         for n, o in decisions.outcomes.items()},
        decisions.draining_since,
    )


def evolve(state: FleetState, now: float, data: st.DataObject) -> None:
    """Like test_sched_properties.evolve, but a start may also still be going."""
    for replica in sorted(state.replicas.values(), key=lambda r: r.id):
        if replica.state is ReplicaState.STARTING:
            replica.state = data.draw(st.sampled_from(
                [ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STARTING]))
            replica.ready_at = now if replica.state is ReplicaState.READY else None
            replica.reason = "boom" if replica.state is ReplicaState.FAILED else None
        elif replica.state is ReplicaState.READY and data.draw(st.integers(0, 4)) == 0:
            replica.last_request_at = now
    act: bool = data.draw(st.booleans())
    if state.nodes and act:
        name = data.draw(st.sampled_from(sorted(state.nodes)))
        state.nodes[name].admin_state = data.draw(
            st.sampled_from([NodeState.READY, NodeState.CORDONED, NodeState.DRAINING])
        )


@passes_settings(60)
@given(fleets(), st.data())
def test_the_shortcut_decides_what_the_full_path_decides(
    state: FleetState, data: st.DataObject
) -> None:
    for record in state.models.values():
        record.spec.start_timeout_s = data.draw(st.sampled_from([30.0, 600.0]))
    policy = Policy(backoff_base_s=data.draw(st.sampled_from([0.0, 5.0])), drain_grace_s=0.0,
                    failure_limit=3)
    now = NOW
    # The reconciler's way: one scheduler across passes, keeping its
    # snapshot and steady models' answers (triagememo.py).
    kept = Scheduler(policy)
    for step in range(6):
        outcomes = []
        for scheduler in (Scheduler(policy, remember=False), full_path(policy), kept):
            ids = (f"r{step}-{n:04d}" for n in itertools.count())
            with patch("llmgw.control.scheduler.shortfall.new_id", lambda ids=ids: next(ids)):
                outcomes.append(scheduler.decide(state, now))
        assert essence(outcomes[0]) == essence(outcomes[1])
        assert essence(outcomes[2]) == essence(outcomes[1])
        apply(state, outcomes[0])
        evolve(state, now, data)
        now += data.draw(st.sampled_from([1.0, 40.0, 400.0]))
        for node in state.nodes.values():
            if node.last_seen is not None and data.draw(st.integers(0, 3)):
                node.last_seen = now  # most nodes keep reporting


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.lists(st.tuples(st.sampled_from(
    ["fail", "drain", "silence", "load", "min", "classes", "reclass", "nothing"]),
    st.integers(0, 1000)), min_size=1, max_size=8))
def test_kept_answers_follow_every_change_that_leaves_the_replicas_be(
    seed: int, changes: list[tuple[str, int]]
) -> None:
    # A generated fleet, placed and ready (most models satisfied, so their
    # answers are kept); then changes that add or remove no replica (so the
    # kept answers are used), each followed by a pass decided both ways.
    state = generate(nodes=24, models=10, fabrics=2, seed=seed, now=NOW)
    for node in state.nodes.values():
        node.last_seen, node.admin_state = NOW, NodeState.READY
    apply(state, decide(state, NOW))
    for replica in state.replicas.values():
        replica.state, replica.ready_at = ReplicaState.READY, NOW
    kept = Scheduler()
    kept.decide(state, NOW)
    now = NOW
    for kind, roll in changes:
        replicas = sorted(state.replicas.values(), key=lambda r: r.id)
        names = sorted(state.nodes)
        node = state.nodes[names[roll % len(names)]]
        record = state.models[sorted(state.models)[roll % len(state.models)]]
        if kind == "fail" and replicas:
            replicas[roll % len(replicas)].state = ReplicaState.FAILED
        elif kind == "drain":
            node.admin_state = NodeState.DRAINING
        elif kind == "silence":
            node.last_seen = now - 1000.0
        elif kind == "load":
            record.load_demand += 1
        elif kind == "min":
            record.spec.min_replicas = roll % 3  # edited in place
        elif kind in ("classes", "reclass") and node.inventory is not None:
            devices = list(node.inventory.devices)
            index = roll % len(devices)
            devices[index] = devices[index].model_copy(
                update={"gpu_class": "l4-24g"} if kind == "reclass"
                else {"healthy": not devices[index].healthy})
            node.inventory = node.inventory.model_copy(update={"devices": devices})
        now += 1.0
        answers = []
        for scheduler in (kept, full_path()):
            ids = (f"k{n:04d}" for n in itertools.count())
            with patch("llmgw.control.scheduler.shortfall.new_id", lambda ids=ids: next(ids)):
                answers.append(scheduler.decide(state, now))
        assert essence(answers[0]) == essence(answers[1]), kind
