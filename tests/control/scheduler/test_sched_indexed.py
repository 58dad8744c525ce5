"""Filters marked ``indexed`` hold for every node the free-device buckets offer.

Placement skips them on candidates taken from the buckets (Placer._place_single),
so a filter marked so that could refuse such a node would let placement use
a node it must not.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from tests.control.scheduler.test_sched_properties import NOW, catalog, nodes

from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.snapshot import build_snapshot
from llmgw.control.state import NodeRecord
from llmgw.sim.fleetgen import fleet
from llmgw.wire import ModelSpec


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(), catalog())
def test_bucket_nodes_pass_every_indexed_filter(
    node_list: list[NodeRecord], specs: list[ModelSpec]
) -> None:
    snapshot = build_snapshot(fleet(node_list, specs, NOW), NOW)
    indexed = [f for f in Placer().filters if getattr(f, "indexed", False)]
    assert {f.name for f in indexed} == {"node-ready", "class-accepted", "enough-free-devices"}
    for spec in specs:
        request = Request.for_spec(spec)
        for gpu_class in request.classes:
            for count, names in snapshot.buckets(gpu_class).items():
                if count < request.per_node:
                    continue
                for name in names:
                    for check in indexed:
                        assert check.check(snapshot.nodes[name], request) is None, (
                            check.name, name, spec.name)
