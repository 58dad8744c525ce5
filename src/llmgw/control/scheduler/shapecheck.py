"""Whether a replica still has its model's shape, and where a model could ever run.

Shared by triage (an outdated replica is moved make-before-break; a model
is parked only when it failed on enough of the nodes that could hold it)
and the steady shortcut, which walks every replica of every model each
pass: hence the per-node class lookups kept for the pass.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placementnode import DeviceCache, PlacementNode
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import ModelSpec, NodeState


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
