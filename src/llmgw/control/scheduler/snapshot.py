"""A point-in-time view of the fleet that placement reads and updates.

Placement must never consult the live FleetState: agent reports change it
while a pass runs, and a decision taken half on old and half on new facts is
how one device ends up given to two replicas. The snapshot is built once per
pass from FleetState, then placements and removals made during the pass are
applied to it (``allocate``/``release``) so later decisions see earlier ones.
Each node is a PlacementNode (placementnode.py).

It also keeps the indexes that make placement cheap at fleet scale: ready
nodes bucketed by their number of free devices per class, entirely free
nodes per class and fabric, and nodes per model whose weights they hold.
Without them every placement is a scan of every node, which at 2,000 nodes
and thousands of replicas turns a pass into seconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from llmgw import memory
from llmgw.control.scheduler.placementnode import (
    DeviceCache,
    PlacementNode,
    copy_node,
    placement_node,
)
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.wire import NodeState

# An insertion-ordered set: iteration order must not depend on string hash
# seeds, or the planner and the reconciler could pick different nodes for the
# same state in two processes.
OrderedSet = dict[str, None]


class PlacementSnapshot:
    """Nodes by name plus the indexes over them; see the module docstring.

    A snapshot can be forked (``fork``): the fork shares every node view and
    index with its parent and copies one only before changing it, so a pass
    that places nothing copies nothing. The reconciler keeps one snapshot
    across passes this way (keeper.py) instead of building 10,000 node views
    every pass.

    Iteration orders are part of the answer: placement takes the first
    feasible nodes of a bucket, so two snapshots of the same fleet must list
    every index in the same order, or the planner (which builds its own)
    would predict other nodes than the reconciler picks. A built snapshot
    lists each index by node name; one changed by the keeper is put back in
    that order (``canonical``).
    """

    def __init__(
        self,
        now: float,
        nodes: dict[str, PlacementNode],
        ram_need: dict[str, memory.RamNeed] | None = None,
    ) -> None:
        self.now = now
        self.nodes = nodes
        # model -> MiB of RAM one shard on CPU slots is charged (llmgw.memory);
        # models absent here are not placed against RAM.
        self.ram_need = ram_need or {}
        # class -> free count -> ready nodes with exactly that many free.
        self._buckets: dict[str, dict[int, OrderedSet]] = {}
        # class -> fabric -> ready nodes with nothing placed on them.
        self._whole_free: dict[str, dict[str, OrderedSet]] = {}
        # model -> nodes holding its weights (any state).
        self._holders: dict[str, OrderedSet] = {}
        # class -> nodes having at least one device of it (any state).
        self._class_nodes: dict[str, OrderedSet] = {}
        # class -> a number standing for what its nodes look like (see
        # ``version``); dropped whenever one of those nodes changes.
        self._versions: dict[str, int] = {}
        # Views whose ``owner`` is not this token are shared with another
        # snapshot and copied before a change (``_own``).
        self._token = object()
        # The bucket and free-node indexes are shared with another snapshot
        # (copied before a change), as are the holder and class indexes.
        self._placing_shared = False
        self._holding_shared = False
        # Index entries changed out of name order (see ``canonical``); None
        # while nothing needs to put them back.
        self._unordered: set[tuple[str, str, object]] | None = None
        token = self._token
        for view in nodes.values():
            view.owner = token
            for model in view.weights:
                self._holders.setdefault(model, {})[view.name] = None
            for gpu_class in view.total:
                self._class_nodes.setdefault(gpu_class, {})[view.name] = None
            self._index(view)

    # -- sharing -----------------------------------------------------------------

    def fork(self, now: float) -> PlacementSnapshot:
        """A snapshot equal to this one, sharing everything until either changes it."""
        # Versions are settled before the copy, so that an answer memoised
        # in this pass's fork holds for the next pass's while nothing changed.
        for gpu_class in self._class_nodes:
            self.version(gpu_class)
        other = PlacementSnapshot.__new__(PlacementSnapshot)
        other.now = now
        other.nodes = dict(self.nodes)
        other.ram_need = self.ram_need
        other._buckets = self._buckets
        other._whole_free = self._whole_free
        other._holders = self._holders
        other._class_nodes = self._class_nodes
        other._versions = dict(self._versions)
        other._token = object()
        other._placing_shared = other._holding_shared = True
        other._unordered = None
        # Both sides now hold views and indexes the other reads.
        self._token = object()
        self._placing_shared = self._holding_shared = True
        return other

    def _own(self, name: str) -> PlacementNode:
        view = self.nodes[name]
        if view.owner is not self._token:
            view = self.nodes[name] = copy_node(view, self._token)
        return view

    def _placing(self) -> None:
        if self._placing_shared:
            self._buckets = {c: _copy_sets(b) for c, b in self._buckets.items()}
            self._whole_free = {c: _copy_sets(b) for c, b in self._whole_free.items()}
            self._placing_shared = False

    def _holding(self) -> None:
        if self._holding_shared:
            self._holders = {m: dict(v) for m, v in self._holders.items()}
            self._class_nodes = {c: dict(v) for c, v in self._class_nodes.items()}
            self._holding_shared = False

    # -- indexes ---------------------------------------------------------------

    def _index(self, view: PlacementNode) -> None:
        if view.state is not NodeState.READY:
            return
        self._placing()
        unordered = self._unordered
        for gpu_class, free in view.free.items():
            if free:
                self._buckets.setdefault(gpu_class, {}).setdefault(len(free), {})[view.name] = None
                if unordered is not None:
                    unordered.add(("bucket", gpu_class, len(free)))
        if view.entirely_free:
            for gpu_class, cap in view.capacity.items():
                if cap:
                    by_fabric = self._whole_free.setdefault(gpu_class, {})
                    for fabric in view.fabrics:
                        by_fabric.setdefault(fabric, {})[view.name] = None
                        if unordered is not None:
                            unordered.add(("whole", gpu_class, fabric))

    def _unindex(self, view: PlacementNode) -> None:
        if view.state is not NodeState.READY:
            return
        self._placing()
        for gpu_class, free in view.free.items():
            if free:
                bucket = self._buckets.get(gpu_class, {}).get(len(free))
                if bucket is not None:
                    bucket.pop(view.name, None)
                    if not bucket:
                        del self._buckets[gpu_class][len(free)]
        if view.entirely_free:
            for gpu_class in view.capacity:
                by_fabric = self._whole_free.get(gpu_class, {})
                for fabric in view.fabrics:
                    by_fabric.get(fabric, {}).pop(view.name, None)

    def buckets(self, gpu_class: str) -> Mapping[int, OrderedSet]:
        """Ready nodes by their number of free ``gpu_class`` devices."""
        return self._buckets.get(gpu_class, {})

    def whole_free(self, gpu_class: str) -> Mapping[str, OrderedSet]:
        """Ready, entirely free nodes with ``gpu_class`` devices, by fabric."""
        return self._whole_free.get(gpu_class, {})

    def holders(self, model: str) -> OrderedSet:
        return self._holders.get(model, {})

    def class_nodes(self, gpu_class: str) -> OrderedSet:
        return self._class_nodes.get(gpu_class, {})

    def version(self, gpu_class: str) -> int:
        """A number that changes whenever a node having ``gpu_class`` changes.

        Two snapshots with equal versions for a request's classes (and the
        same number of nodes) give that request the same placement answer,
        which lets the reconciler reuse an "unplaceable" from the previous
        pass instead of explaining it again every pass. Versions are drawn
        from one counter for the whole process and never reused, so equal
        versions mean the same facts: the same snapshot, or a fork of it
        that changed nothing there. A class no node has is 0 everywhere.
        """
        found = self._versions.get(gpu_class)
        if found is None:
            if gpu_class not in self._class_nodes:
                return 0  # no node has it: nothing about it can differ
            found = self._versions[gpu_class] = next(_VERSIONS)
        return found

    def _touched(self, view: PlacementNode) -> None:
        for gpu_class in view.total:
            self._versions.pop(gpu_class, None)

    # -- changes made during a pass ---------------------------------------------

    def allocate(self, node: str, numbers: Iterable[int], model: str) -> None:
        """Mark devices of ``node`` as held by a replica of ``model``."""
        view = self._own(node)
        self._unindex(view)
        self._touched(view)
        view.hold(set(numbers), model, self.ram_need.get(model))
        self._index(view)

    def release(self, node: str, numbers: Iterable[int], model: str) -> None:
        """Give the devices back, e.g. for a replica removed in this pass."""
        if node not in self.nodes:
            return
        view = self._own(node)
        self._unindex(view)
        self._touched(view)
        given = set(numbers)
        view.release_ram(given, self.ram_need.get(model))
        for number in given:
            gpu_class = view.device_class.get(number)
            if gpu_class is None or number not in view.placeable:
                continue
            free = view.free.setdefault(gpu_class, [])
            if number in free:
                continue
            free.append(number)
            free.sort()
            view.used[gpu_class] -= 1
            view.used_total -= 1
        count = view.replicas.get(model, 0) - 1
        if count > 0:
            view.replicas[model] = count
        else:
            view.replicas.pop(model, None)
        self._index(view)

    def allocate_replica(self, replica: ReplicaRecord) -> None:
        for shard in replica.shards:
            if shard.node in self.nodes:
                self.allocate(shard.node, shard.device_numbers, replica.model)

    def release_replica(self, replica: ReplicaRecord) -> None:
        for shard in replica.shards:
            self.release(shard.node, shard.device_numbers, replica.model)

    # -- whole nodes (the keeper's changes between passes) -----------------------

    def put_node(self, view: PlacementNode) -> None:
        """Add ``view`` or replace the node's view by it (indexes follow)."""
        old = self.nodes.get(view.name)
        self.begin_changes()
        unordered = self._unordered
        assert unordered is not None
        # The holder and class indexes change only with weights or classes.
        rehold = old is None or old.weights != view.weights or old.total.keys() != view.total.keys()
        if old is None:
            unordered.add(("nodes", "", None))
        else:
            self._unindex(old)
            self._touched(old)
        if rehold:
            self._holding()
            if old is not None:
                self._unhold(old)
            for model in view.weights:
                self._holders.setdefault(model, {})[view.name] = None
                unordered.add(("holders", model, None))
            for gpu_class in view.total:
                self._class_nodes.setdefault(gpu_class, {})[view.name] = None
                unordered.add(("classes", gpu_class, None))
        view.owner = self._token
        self.nodes[view.name] = view
        self._touched(view)
        self._index(view)

    def drop_node(self, name: str) -> None:
        old = self.nodes.pop(name, None)
        if old is None:
            return
        self._holding()
        self._unindex(old)
        self._touched(old)
        self._unhold(old)

    def _unhold(self, view: PlacementNode) -> None:
        for model in view.weights:
            _discard(self._holders, model, view.name)
        for gpu_class in view.total:
            _discard(self._class_nodes, gpu_class, view.name)

    def begin_changes(self) -> None:
        """From now on, remember which index entries fall out of name order."""
        if self._unordered is None:
            self._unordered = set()

    def canonical(self) -> None:
        """Put every index changed since ``begin_changes`` back in name order."""
        unordered, self._unordered = self._unordered, None
        for kind, key, sub in unordered or ():
            if kind == "nodes":
                self.nodes = dict(sorted(self.nodes.items()))
            elif kind == "bucket" and isinstance(sub, int):
                _sort_entry(self._buckets.get(key, {}), sub)
            elif kind == "whole" and isinstance(sub, str):
                _sort_entry(self._whole_free.get(key, {}), sub)
            elif kind == "holders":
                _sort_entry(self._holders, key)
            elif kind == "classes":
                _sort_entry(self._class_nodes, key)


def _copy_sets(sets: dict[Any, OrderedSet]) -> dict[Any, OrderedSet]:
    return {key: dict(found) for key, found in sets.items()}


def _sort_entry(parent: dict[Any, OrderedSet], key: object) -> None:
    found = parent.get(key)
    if found is not None and len(found) > 1:
        parent[key] = dict.fromkeys(sorted(found))


_VERSIONS = itertools.count(1)


def _discard(index: dict[str, OrderedSet], key: str, name: str) -> None:
    found = index.get(key)
    if found is not None:
        found.pop(name, None)
        if not found:
            del index[key]


def ram_needs(state: FleetState) -> dict[str, memory.RamNeed]:
    """What one CPU shard of each RAM-placed model is charged (llmgw.memory.RamNeed).

    The weights size is the largest any node reports for the model; before
    any node holds them the estimate has its fixed part only, and the agent,
    which knows the file, enforces the whole of it.
    """
    specs = {n: r.spec for n, r in state.models.items() if memory.places_on_ram(r.spec)}
    if not specs:
        return {}
    sizes: dict[str, int] = {}
    for node in state.nodes.values():
        for entry in node.weights:
            if entry.model in specs and entry.size_bytes > sizes.get(entry.model, 0):
                sizes[entry.model] = entry.size_bytes
    return {name: memory.RamNeed.of(spec, sizes.get(name)) for name, spec in specs.items()}


def build_snapshot(
    state: FleetState,
    now: float,
    *,
    exclude: Iterable[str] = (),
    cache: DeviceCache | None = None,
    states: Mapping[str, NodeState] | None = None,
) -> PlacementSnapshot:
    """The fleet as placement sees it at ``now``.

    ``exclude`` names replicas whose devices count as free (replicas the
    current pass is removing); ``cache`` keeps digested inventories between
    passes; ``states``: every node's ``state(now)``, when the caller has them.
    """
    views = {
        name: placement_node(node, now, cache, None if states is None else states[name])
        for name, node in sorted(state.nodes.items())
    }
    if cache is not None:
        cache.forget_missing(views)
    skip = set(exclude)
    ram_need = ram_needs(state)
    for replica in state.replicas.values():
        if replica.id in skip:
            continue
        for shard in replica.shards:
            view = views.get(shard.node)
            if view is not None:
                view.hold(shard.device_numbers, replica.model, ram_need.get(replica.model))
    return PlacementSnapshot(now, views, ram_need)
