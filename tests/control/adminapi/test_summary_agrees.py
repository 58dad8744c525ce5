"""The summary agrees with the listings, on random fleets (property-style).

Each figure of the summary is recomputed here from the node, replica and
model listings alone -- device by device, replica by replica -- so a rule
that drifts between the two paths fails with a concrete fleet.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.control.adminapi.fleetkit import Fleet, gpu, mig

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, fleet_summary, summarize
from llmgw.control.adminapi.views.fleet import FleetViews, fleet_views
from llmgw.control.adminapi.views.models import desired_now
from llmgw.control.scheduler.demand import desired_count as scheduler_desired
from llmgw.wire import NodeState, ReplicaState

CLASSES = ["h100-80g", "a100-80g", "cpu"]
STATES = list(ReplicaState)


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    fleet = Fleet()
    n_models = draw(st.integers(0, 4))
    for m in range(n_models):
        lo = draw(st.integers(0, 2))
        fleet.model(
            f"m{m}",
            min_replicas=lo,
            max_replicas=draw(st.integers(max(lo, 1), 3)),
            gpu_classes=CLASSES,
            parked=draw(st.booleans()),
            failures=draw(st.integers(0, 5)),
            last_error=draw(st.sampled_from([None, "engine exited (1)"])),
            demand_at=draw(st.sampled_from([None, fleet.now - 5, fleet.now - 5000])),
            unplaceable_reason=draw(st.sampled_from([None, "no free h100-80g"])),
            load_demand=draw(st.integers(0, 1)),
        )
    for n in range(draw(st.integers(0, 6))):
        devices = []
        for number in range(draw(st.integers(0, 4))):
            healthy = draw(st.booleans()) or draw(st.booleans())
            placeable = draw(st.booleans()) or draw(st.booleans()) or draw(st.booleans())
            devices.append(gpu(number, draw(st.sampled_from(CLASSES)), healthy=healthy,
                               placeable=placeable, reason="x"))
        if draw(st.booleans()):
            devices += [mig(7, 0), mig(7, 1)]
        fleet.node(
            f"n{n}", devices,
            fabrics=tuple(draw(st.lists(st.sampled_from(["ib-a", "ib-b", "ib-c"]),
                                        max_size=2, unique=True))),
            weights=tuple(draw(st.lists(st.sampled_from(["m0", "m1", "x"]), max_size=2,
                                        unique=True))),
            admin_state=draw(st.sampled_from([NodeState.READY, NodeState.CORDONED,
                                              NodeState.DRAINING])),
            seen_ago=draw(st.sampled_from([1.0, 1.0, 100.0])),
        )
        free = [d.number for d in devices]
        while free and n_models and draw(st.booleans()):
            take = draw(st.integers(1, len(free)))
            numbers, free = free[:take], free[take:]
            fleet.replica(f"m{draw(st.integers(0, n_models - 1))}", f"n{n}", numbers,
                          state=draw(st.sampled_from(STATES)),
                          idle=draw(st.sampled_from([None, 5.0, IDLE_THRESHOLD_S - 1.0,
                                                     IDLE_THRESHOLD_S, 7200.0])))
    return fleet


def expected_from_listings(views: FleetViews) -> dict[str, object]:
    """The summary's figures, recomputed from the listings only."""
    per_class: dict[str, Counter[str]] = {}
    for node in views.nodes:
        for device in node.devices:
            per_class.setdefault(device.gpu_class, Counter())[device.status] += 1
    gpus = {
        c: (sum(n.values()), n["used"], n["unhealthy"] + n["unplaceable"], n["free"])
        for c, n in per_class.items()
    }
    fabrics: dict[str, tuple[int, int, int, int]] = {}
    for name in {f for n in views.nodes for f in n.fabrics}:
        members = [n for n in views.nodes if name in n.fabrics]
        fabrics[name] = (
            len(members),
            sum(1 for n in members if n.models),
            len({m for n in members for m in n.models}),
            sum(1 for n in members if n.state == "ready" and n.devices
                and all(d.status == "free" for d in n.devices)),
        )
    idle = sorted(
        ((r.idle_seconds or 0, r.id, r.gpus) for r in views.replicas
         if r.state == "ready" and (r.idle_seconds or 0) >= IDLE_THRESHOLD_S),
        key=lambda t: (-t[0], t[1]),
    )
    satisfied = [m for m in views.models if m.ready >= m.desired and not m.parked]
    for m in views.models:
        listed = Counter(r.state for r in views.replicas if r.model == m.name)
        assert (m.ready, m.starting, m.draining, m.failed) == (
            listed["ready"], listed["starting"], listed["draining"], listed["failed"])
    return {
        "nodes": Counter(n.state for n in views.nodes),
        "gpus": gpus,
        "fabrics": fabrics,
        "replicas": Counter(r.state for r in views.replicas),
        "idle": idle,
        "models": (len(views.models), len(satisfied), len(views.models) - len(satisfied)),
        "parked": sorted(m.name for m in views.models if m.parked),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_summary_agrees_with_the_listings(fleet: Fleet) -> None:
    views = fleet_views(fleet.state, fleet.now)
    summary = fleet_summary(fleet.state, fleet.now, StoreStatus(members=[]))
    assert summarize(views, StoreStatus(members=[])) == summary
    want = expected_from_listings(views)
    nodes = want["nodes"]
    assert isinstance(nodes, Counter)
    s = summary
    assert (s.nodes.total, s.nodes.ready, s.nodes.cordoned, s.nodes.draining,
            s.nodes.unreachable) == (sum(nodes.values()), nodes["ready"], nodes["cordoned"],
                                     nodes["draining"], nodes["unreachable"])
    assert {u.gpu_class: (u.total, u.used, u.unhealthy, u.free) for u in s.gpus} == want["gpus"]
    assert {f.fabric: (f.nodes, f.nodes_with_weights, f.models_present, f.largest_free_block)
            for f in s.fabrics} == want["fabrics"]
    replicas = want["replicas"]
    assert isinstance(replicas, Counter)
    assert (s.replicas.ready, s.replicas.starting, s.replicas.draining, s.replicas.failed) == (
        replicas["ready"], replicas["starting"], replicas["draining"], replicas["failed"])
    assert [(i.idle_seconds, i.id, i.gpus) for i in s.idle_replicas] == want["idle"]
    assert (s.models.total, s.models.satisfied, s.models.short) == want["models"]
    assert [p.model for p in s.parked] == want["parked"]
    # The reference's rule, to the letter: parked models are exempt from its
    # second half only.
    assert s.unplaceable == sorted(
        m.name for m in views.models
        if not (m.ready >= m.desired and not m.parked)
        and (m.unplaceable or (m.total <= m.ready and not m.parked))
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_desired_now_is_the_schedulers_rule(fleet: Fleet) -> None:
    views = fleet_views(fleet.state, fleet.now)
    by_name = {m.name: m for m in views.models}
    for name, record in fleet.state.models.items():
        live = [r for r in fleet.state.replicas_of(name)
                if r.state in (ReplicaState.READY, ReplicaState.STARTING) and not r.draining]
        assert by_name[name].desired == scheduler_desired(record, live, fleet.now)
        if not live:
            assert desired_now(record, fleet.now) == by_name[name].desired
